"""deepspeed."""
