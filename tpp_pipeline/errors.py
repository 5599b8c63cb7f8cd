"""The single error type of the data pipeline."""


class DataError(Exception):
    """Bad input or inconsistent intermediate data.

    The message always says which file (and, where it makes sense, which 1-based line)
    is at fault, so that a failure hours into a WMT run can be traced without a debugger.
    """

    def __init__(self, message, path=None, line=None):
        where = ""
        if path is not None:
            where = f"{path}:{line}: " if line is not None else f"{path}: "
        super().__init__(where + message)
        self.message = message
        self.path = path
        self.line = line
