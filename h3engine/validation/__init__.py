"""The validation kit (issue 33): checkpoint probe, boundary capture, the diffusers reference run, comparison.

`trace` records a request's boundaries (off unless a capture is active), `compare` reads two captures and names the
first boundary that diverges, `checkpoint_probe` checks a checkpoint folder, `reference` runs diffusers' pipeline.
"""
