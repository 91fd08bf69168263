"""Sampling: sigma schedules and the Euler step, packing layouts, noise recipes, and the DiT's AdaLN tables of a
request's steps (modulation)."""
