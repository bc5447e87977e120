"""Vision towers: image encoders that turn a batch of frames into patch features, each pure (no engine
knowledge), named as in Hugging Face checkpoints so a family's hook only strips a prefix."""
