"""Output formats. Each module holds one converter; see converters.registry."""
