"""LoRA adapters: reading PEFT adapter directories, merging and exporting them."""
