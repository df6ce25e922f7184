"""Deferred initialization: give a meta-device model the values an eager build would have."""

from zerobridge.init.replay import Replay, is_meta_model

__all__ = ["Replay", "is_meta_model"]
