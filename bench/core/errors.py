"""The one error type for bad input: its message is the single line the user sees."""


class ConfigError(ValueError):
    """Invalid configuration or input, found before ranks start. str(e) names the problem and the fix."""
