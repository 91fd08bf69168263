"""Sampling: sigma schedules and the Euler step, packing layouts, noise recipes, the DiT's AdaLN tables of a
request's steps (modulation), the step cache, and the denoising loop with its holds (denoise_steps)."""
