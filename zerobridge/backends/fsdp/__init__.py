"""fsdp."""
