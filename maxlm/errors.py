"""The error a user's mistake raises, importable from any layer without the config module.

Every bad input (config, data, checkpoint, CLI, launch flags) becomes one ConfigError whose message is a
single line naming the problem and the fix; `train.py` prints it as `maxlm: error: ...` and exits 2.
"""


class ConfigError(ValueError):
    """A user-facing problem with the input; its message is a single line naming the fix."""
