"""The recipes' error, in a module of its own: the command line catches it without importing
torch (which every recipe module imports)."""


class DataError(ValueError):
    """A recipe's data is missing, unreadable or too small."""
