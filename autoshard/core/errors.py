"""The one exception type users see for problems autoshard can explain."""


class AutoshardError(RuntimeError):
    """A model or launch autoshard cannot handle; the message says what and how to fix it."""
