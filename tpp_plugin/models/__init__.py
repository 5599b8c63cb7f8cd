from .transformer_pp import TransformerPPModel  # noqa: F401 (registers the model and presets)
