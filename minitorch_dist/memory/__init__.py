"""Chapter 06 — saving memory: ZeRO/FSDP and Adafactor (06), checkpointing and activation
offload (07), mixed precision (08)."""
