"""The overlay: overlay.toml model, strict patches, the checkout (apply), export, history."""
