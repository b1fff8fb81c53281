"""The one exception type for usage errors in plugins, flags and inputs."""


class PluginError(Exception):
    """A usage error: a bad flag, plugin, file or input.

    The CLI prints only the message (no traceback unless ``--debug``) and exits with
    code 2. Messages name what failed, the flag, file or plugin at fault, what is
    available, and what to do.
    """
