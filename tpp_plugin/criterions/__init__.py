from .label_smoothed_cross_entropy_with_tags import (  # noqa: F401 (registers the criterion)
    LabelSmoothedCrossEntropyWithTagsCriterion,
)
