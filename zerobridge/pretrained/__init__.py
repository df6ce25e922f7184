"""Pretrained weights into a prepared model, each rank reading only its own runs."""

from zerobridge.pretrained.load import LoadReport, load_pretrained

__all__ = ["LoadReport", "load_pretrained"]
