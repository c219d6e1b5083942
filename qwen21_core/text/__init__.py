"""The Qwen3-VL text encoder wrapper (and the tiny offline copy tests use)."""
