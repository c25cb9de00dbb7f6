class ModelLoadError(ValueError):
    """A model path that cannot be served: missing, unreadable, corrupt or unsupported."""
