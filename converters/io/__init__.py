"""Low-level readers and writers: validated safetensors access, streaming writers."""
