"""LoRA adapters: applying them beside a DiT's linears (adapters), and the folder of them the app lists (library)."""
