from .translation_with_tags import TranslationWithTagsTask  # noqa: F401 (registers the task)
