"""Media files: the accepted formats, the input readers and probes (Pillow, PyAV), MP4 muxing and sidecars, and
what a killed run leaves behind."""
