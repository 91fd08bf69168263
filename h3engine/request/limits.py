"""The limits a request is held to that more than one layer needs: the request rules (h3engine.request) enforce
them, the memory planner (h3engine.memory.shapes) plans for the largest request they allow. Plain values, no
imports. The tasks themselves are the checkpoint layout's (h3engine.checkpoint.layout.TASKS).
"""

# SGLang checks the *requested* duration, before the 17n+5 snap (so 15 s becomes 362 frames, 15.083 s).
MIN_DURATION_SECONDS = 4.0
MAX_DURATION_SECONDS = 15.0
MIN_CLIP_SECONDS = 2.0
MAX_CLIP_SECONDS = 15.0
MAX_TOTAL_VIDEO_SECONDS = 15.0
MAX_TOTAL_AUDIO_SECONDS = 15.0
MAX_REFERENCES_OF_KIND = {"image": 9, "video": 3, "audio": 3}
MAX_REFERENCES = 12
# The largest short edge the released model encodes at all: Ref2VA normalizes image references to 2048.
MAX_SHORT_EDGE = 2048
# The prompt's own tokens (h3engine.request says why 8,192).
MAX_PROMPT_TOKENS = 8_192
# Denoising steps of a request that names none (GenerationRequest.steps; the planner's design request).
DEFAULT_STEPS = 50
# No load decodes past this point of a file: it bounds the work a long or lying file can cause (h3engine.media).
MAX_MEDIA_SECONDS = 120.0
