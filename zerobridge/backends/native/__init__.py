"""native."""
