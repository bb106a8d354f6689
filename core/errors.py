"""The one exception type for user mistakes (bad config, data, plugin or model files).

The CLI prints a `UserError` as one line and exits with status 2; anything else is a bug and
keeps its traceback.
"""


class UserError(Exception):
    """A problem the user can fix; the message names it (key, file, plugin)."""
