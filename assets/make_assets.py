"""Draw and synthesize the bundled example inputs under assets/, then write assets/PROVENANCE.md.

Usage: `python assets/make_assets.py [--out DIR]` (default: the folder this script lives in).

Contract:
* Every file is made here, from code: shapes drawn with Pillow (the cafe's chalkboard lettering uses Pillow's
  built-in default font, nothing else), sound synthesized with numpy, the MP4 encoded through our own
  `h3engine.media.mux.write_mp4` (PyAV's FFmpeg: libx264 + AAC). Nothing is downloaded or read from disk, so no
  third-party media can slip in.
* Deterministic: no clocks, no random generators, no metadata that records a time or a host. PNG, JPEG and WAV
  bytes are a function of this code and of the Pillow build (its zlib and libjpeg-turbo) alone; MP4 bytes also
  depend on the FFmpeg build (x264 and the AAC encoder), so tests/test_assets.py checks the MP4's stream
  properties instead of its hash.
* PROVENANCE.md is written from the same recipe table that makes the files, with the sha256 of the bytes just
  written, so the provenance cannot drift from the files.

Danger: tests/test_assets.py regenerates everything and compares the PNG/JPEG/WAV hashes with PROVENANCE.md.
Any change to a drawing, a parameter or the Pillow/zlib build changes them: rerun this script and commit the new
files together with the new PROVENANCE.md. Keep the artwork flat (few colours, large shapes): the whole folder
has to stay under ~3 MB.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import wave
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import av
import numpy as np
import PIL
from PIL import Image, ImageDraw, ImageFont, features

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    # `python assets/make_assets.py` puts assets/ on the import path, not the repository root.
    sys.path.insert(0, str(REPO_ROOT))

from h3engine.media.mux import probe_mp4, write_mp4  # noqa: E402

ASSETS_FOLDER = Path(__file__).resolve().parent
SAMPLE_RATE = 32_000
VIDEO_FPS = 24
# Shapes are drawn at this multiple of the output size and box-filtered down: cheap anti-aliasing that keeps
# the artwork flat enough to compress well.
SUPERSAMPLE = 2
JPEG_QUALITY = 88
# write_mp4 defaults to CRF 18 / 192 kb/s for generated output; a flat cartoon needs far less.
VIDEO_CRF = 23
AUDIO_BITRATE = 96_000
WAV_PEAK = 0.8

Color = tuple[int, int, int]
Point = tuple[float, float]


# ---------------------------------------------------------------------------------------------------------------
# Drawing helpers


class SupersampledCanvas:
    """An RGB canvas addressed in output pixels, drawn at SUPERSAMPLE times the size and reduced on `finish`."""

    def __init__(self, width: int, height: int, background: Image.Image | Color) -> None:
        self.width, self.height = width, height
        big_size = (width * SUPERSAMPLE, height * SUPERSAMPLE)
        if isinstance(background, Image.Image):
            self.image = background.resize(big_size, Image.Resampling.NEAREST)
        else:
            self.image = Image.new("RGB", big_size, background)
        self.draw = ImageDraw.Draw(self.image)

    @staticmethod
    def _scaled(points: Sequence[Point]) -> list[tuple[int, int]]:
        return [(round(x * SUPERSAMPLE), round(y * SUPERSAMPLE)) for x, y in points]

    def polygon(self, points: Sequence[Point], fill: Color) -> None:
        self.draw.polygon(self._scaled(points), fill=fill)

    def line(self, points: Sequence[Point], fill: Color, width: float) -> None:
        self.draw.line(self._scaled(points), fill=fill, width=round(width * SUPERSAMPLE), joint="curve")

    def ellipse(
        self, center: Point, radii: Point, fill: Color | None, outline: Color | None = None, width: float = 0
    ) -> None:
        (left, top), (right, bottom) = self._scaled(
            [(center[0] - radii[0], center[1] - radii[1]), (center[0] + radii[0], center[1] + radii[1])]
        )
        self.draw.ellipse(
            (left, top, right, bottom), fill=fill, outline=outline, width=round(width * SUPERSAMPLE)
        )

    def rectangle(
        self,
        box: tuple[float, float, float, float],
        fill: Color | None,
        radius: float = 0,
        outline: Color | None = None,
        width: float = 0,
    ) -> None:
        (left, top), (right, bottom) = self._scaled([box[:2], box[2:]])
        self.draw.rounded_rectangle(
            (left, top, right, bottom),
            radius=round(radius * SUPERSAMPLE),
            fill=fill,
            outline=outline,
            width=round(width * SUPERSAMPLE),
        )

    def arc(
        self, box: tuple[float, float, float, float], start: float, end: float, fill: Color, width: float
    ) -> None:
        (left, top), (right, bottom) = self._scaled([box[:2], box[2:]])
        self.draw.arc((left, top, right, bottom), start, end, fill=fill, width=round(width * SUPERSAMPLE))

    def centered_text(self, center: Point, text: str, size: float, fill: Color) -> None:
        if not features.check("freetype2"):
            # Without FreeType, load_default ignores the size and falls back to a tiny bitmap font.
            raise RuntimeError("Pillow was built without FreeType; its default font cannot be scaled")
        font = ImageFont.load_default(size=round(size * SUPERSAMPLE))
        ((x, y),) = self._scaled([center])
        self.draw.text((x, y), text, font=font, fill=fill, anchor="mm")

    def finish(self) -> Image.Image:
        # BOX averages each SUPERSAMPLE x SUPERSAMPLE block exactly (integer arithmetic in Pillow).
        return self.image.resize((self.width, self.height), Image.Resampling.BOX)


def mix(color_a: Sequence[float], color_b: Sequence[float], amount: float) -> Color:
    """The colour `amount` of the way from `color_a` to `color_b`, rounded to 8 bits."""
    return tuple(round(a + (b - a) * amount) for a, b in zip(color_a, color_b, strict=True))


def vertical_gradient(width: int, height: int, stops: Sequence[tuple[float, Color]]) -> Image.Image:
    """Rows coloured by linear interpolation between (position in [0, 1], colour) stops; columns are constant."""
    positions = np.array([position for position, _ in stops], dtype=np.float64)
    colors = np.array([color for _, color in stops], dtype=np.float64)
    rows = np.arange(height, dtype=np.float64) / max(height - 1, 1)
    channels = [np.interp(rows, positions, colors[:, channel]) for channel in range(3)]
    column = np.round(np.stack(channels, axis=-1)).astype(np.uint8)
    return Image.fromarray(np.ascontiguousarray(np.broadcast_to(column[:, None, :], (height, width, 3))))


def gradient_color(stops: Sequence[tuple[float, Color]], position: float) -> Color:
    """The colour `vertical_gradient` gives the row at `position` (0 top, 1 bottom)."""
    positions = [stop_position for stop_position, _ in stops]
    return tuple(
        round(float(np.interp(position, positions, [color[channel] for _, color in stops])))
        for channel in range(3)
    )


def rotate(point: Point, center: Point, degrees: float) -> Point:
    angle = math.radians(degrees)
    dx, dy = point[0] - center[0], point[1] - center[1]
    return (
        center[0] + dx * math.cos(angle) - dy * math.sin(angle),
        center[1] + dx * math.sin(angle) + dy * math.cos(angle),
    )


def save_image(image: Image.Image, path: Path) -> None:
    """PNG (optimized) or JPEG by suffix; neither writer records a time, so the bytes depend on pixels only."""
    if path.suffix.lower() in (".jpg", ".jpeg"):
        # Fixed quality and chroma subsampling; libjpeg-turbo output is byte-stable for a given build.
        image.save(path, format="JPEG", quality=JPEG_QUALITY, subsampling="4:2:0", optimize=True)
    else:
        image.save(path, format="PNG", optimize=True)


# ---------------------------------------------------------------------------------------------------------------
# FL2VA keyframes: a sunrise over hills with a small red kite


DAWN_PALETTE = {
    "sky_top": (58, 50, 118),
    "sky_middle": (196, 112, 140),
    "sky_horizon": (252, 178, 116),
    "sun": (255, 214, 120),
    "cloud": (250, 186, 170),
    "far_hill": (128, 94, 146),
    "middle_hill": (88, 72, 124),
    "near_hill": (52, 46, 90),
    "figure": (30, 26, 48),
}
MORNING_PALETTE = {
    "sky_top": (84, 150, 226),
    "sky_middle": (150, 200, 240),
    "sky_horizon": (214, 236, 250),
    "sun": (255, 244, 184),
    "cloud": (255, 255, 255),
    "far_hill": (126, 178, 136),
    "middle_hill": (84, 152, 92),
    "near_hill": (52, 118, 66),
    "figure": (40, 48, 58),
}
SUN_GLOW = (255, 250, 226)
KITE_RED = (220, 32, 40)
KITE_SPAR = (110, 16, 22)
KITE_BOW = (255, 206, 60)
STRING_COLOR = (70, 60, 60)

# Each hill line is a base height plus (amplitude, period, phase) sine terms, in output pixels.
HILL_SHAPES = {
    "far_hill": (560.0, ((26.0, 700.0, 0.6), (12.0, 260.0, 1.3))),
    "middle_hill": (628.0, ((30.0, 900.0, 2.1), (10.0, 330.0, 0.2))),
    "near_hill": (692.0, ((34.0, 1100.0, 4.0), (8.0, 410.0, 2.5))),
}
CLOUDS = (((220.0, 150.0), 1.0), ((640.0, 96.0), 0.8), ((1150.0, 190.0), 1.2))
KITE_FLYER_X = 300.0


def hill_height(name: str, x: float) -> float:
    base, terms = HILL_SHAPES[name]
    return base + sum(
        amplitude * math.sin(2 * math.pi * x / period + phase) for amplitude, period, phase in terms
    )


def draw_sunrise_keyframe(
    path: Path,
    *,
    width: int,
    height: int,
    daylight: float,
    sun_center: Point,
    sun_radius: float,
    kite_center: Point,
    kite_tilt_degrees: float,
    cloud_drift: float,
) -> None:
    """A stylized sunrise: gradient sky, sun with halo, clouds, three hill bands, a child flying a red kite.

    `daylight` blends the dawn palette (0) into the morning palette (1); the sun, kite and clouds are placed
    by the other parameters, so a first and a last keyframe differ in exactly what the prompt describes.
    """
    palette = {name: mix(DAWN_PALETTE[name], MORNING_PALETTE[name], daylight) for name in DAWN_PALETTE}
    horizon = HILL_SHAPES["far_hill"][0] / height
    sky_stops = [
        (0.0, palette["sky_top"]),
        (horizon * 0.55, palette["sky_middle"]),
        (horizon, palette["sky_horizon"]),
    ]
    canvas = SupersampledCanvas(width, height, vertical_gradient(width, height, sky_stops))

    sky_at_sun = gradient_color(sky_stops, sun_center[1] / height)
    for ring, strength in ((2.1, 0.2), (1.7, 0.4), (1.35, 0.65)):
        canvas.ellipse(
            sun_center, (sun_radius * ring, sun_radius * ring), mix(sky_at_sun, SUN_GLOW, strength)
        )
    canvas.ellipse(sun_center, (sun_radius, sun_radius), palette["sun"])

    for (x, y), size in CLOUDS:
        x += cloud_drift
        for dx, dy, rx, ry in ((0, 0, 70, 26), (-52, 8, 44, 20), (54, 6, 50, 22), (10, -16, 44, 24)):
            canvas.ellipse((x + dx * size, y + dy * size), (rx * size, ry * size), palette["cloud"])

    for name in ("far_hill", "middle_hill", "near_hill"):
        outline = [(float(x), hill_height(name, x)) for x in range(0, width + 1, 8)]
        canvas.polygon([*outline, (width, height), (0, height)], palette[name])

    hand = draw_kite_flyer(canvas, palette["figure"], KITE_FLYER_X, hill_height("near_hill", KITE_FLYER_X))
    draw_kite(canvas, kite_center, kite_tilt_degrees, hand)
    save_image(canvas.finish(), path)


def draw_kite_flyer(canvas: SupersampledCanvas, color: Color, x: float, ground: float) -> Point:
    """A small silhouette standing on the near hill with one arm raised; returns the raised hand."""
    hip, shoulder, head = ground - 34, ground - 66, ground - 82
    canvas.line([(x - 10, ground), (x, hip), (x + 10, ground)], color, 6)
    canvas.line([(x, hip), (x, shoulder)], color, 8)
    canvas.line([(x, shoulder + 4), (x - 14, hip + 2)], color, 5)
    hand = (x + 22, shoulder - 22)
    canvas.line([(x, shoulder + 4), hand], color, 5)
    canvas.ellipse((x, head), (11, 11), color)
    return hand


def draw_kite(canvas: SupersampledCanvas, center: Point, tilt_degrees: float, hand: Point) -> None:
    """A diamond kite with cross spars, a bowed tail and a sagging string down to `hand`."""
    x, y = center
    top, right, bottom, left = (x, y - 46), (x + 30, y - 10), (x, y + 54), (x - 30, y - 10)
    corners = [rotate(point, center, tilt_degrees) for point in (top, right, bottom, left)]
    tail_start = corners[2]

    middle = ((center[0] + hand[0]) / 2, (center[1] + hand[1]) / 2 + 40)
    string = [quadratic_point(center, middle, hand, step / 24) for step in range(25)]
    canvas.line(string, STRING_COLOR, 1.5)

    tail = [
        (tail_start[0] + 8 * step + 9 * math.sin(step * 1.3), tail_start[1] + 15 * step) for step in range(8)
    ]
    canvas.line(tail, KITE_SPAR, 2.5)
    for bow_x, bow_y in tail[2::2]:
        canvas.polygon(
            [
                (bow_x - 10, bow_y - 6),
                (bow_x + 10, bow_y + 6),
                (bow_x + 10, bow_y - 6),
                (bow_x - 10, bow_y + 6),
            ],
            KITE_BOW,
        )

    canvas.polygon(corners, KITE_RED)
    canvas.line([corners[0], corners[2]], KITE_SPAR, 3)
    canvas.line([corners[3], corners[1]], KITE_SPAR, 3)


def quadratic_point(start: Point, control: Point, end: Point, t: float) -> Point:
    return (
        (1 - t) ** 2 * start[0] + 2 * (1 - t) * t * control[0] + t**2 * end[0],
        (1 - t) ** 2 * start[1] + 2 * (1 - t) * t * control[1] + t**2 * end[1],
    )


# ---------------------------------------------------------------------------------------------------------------
# Ref2VA picture 1: a friendly robot (portrait)


ROBOT_OUTLINE = (28, 78, 92)
ROBOT_METAL = (150, 162, 178)
ROBOT_DARK = (44, 56, 70)


def draw_robot(
    path: Path, *, width: int, height: int, body_color: Color, head_color: Color, antenna_color: Color
) -> None:
    """A small waving robot standing on a plain floor, full figure, facing the viewer."""
    background = vertical_gradient(
        width, height, [(0.0, (236, 240, 250)), (0.85, (212, 222, 240)), (1.0, (212, 222, 240))]
    )
    canvas = SupersampledCanvas(width, height, background)
    canvas.rectangle((0, 880, width, height), (188, 198, 216))
    center = width / 2

    canvas.ellipse((center, 906), (176, 24), (160, 170, 192))
    for leg_x in (center - 52, center + 52):
        canvas.rectangle(
            (leg_x - 22, 720, leg_x + 22, 870), ROBOT_METAL, radius=10, outline=ROBOT_OUTLINE, width=4
        )
        canvas.rectangle((leg_x - 42, 852, leg_x + 42, 900), ROBOT_DARK, radius=18)

    canvas.line([(center - 150, 520), (center - 214, 610), (center - 212, 690)], ROBOT_METAL, 32)
    canvas.ellipse((center - 212, 700), (32, 32), ROBOT_DARK)
    canvas.line([(center + 150, 520), (center + 246, 462), (center + 262, 356)], ROBOT_METAL, 32)
    canvas.ellipse((center + 262, 340), (34, 34), ROBOT_DARK)

    canvas.rectangle(
        (center - 158, 468, center + 158, 748), body_color, radius=44, outline=ROBOT_OUTLINE, width=6
    )
    canvas.rectangle(
        (center - 96, 530, center + 96, 690), (232, 246, 246), radius=22, outline=ROBOT_OUTLINE, width=4
    )
    draw_heart(canvas, (center, 596), 30, (232, 72, 86))
    for offset, color in ((-56, (250, 196, 60)), (0, (90, 200, 120)), (56, (90, 150, 240))):
        canvas.ellipse((center + offset, 660), (12, 12), color)

    canvas.rectangle((center - 34, 428, center + 34, 476), ROBOT_METAL, outline=ROBOT_OUTLINE, width=4)
    for side in (-1, 1):
        canvas.rectangle(
            (center + side * 170 - 14, 268, center + side * 170 + 14, 372),
            ROBOT_METAL,
            radius=10,
            outline=ROBOT_OUTLINE,
            width=4,
        )
    canvas.line([(center, 200), (center, 128)], ROBOT_DARK, 8)
    canvas.ellipse((center, 116), (22, 22), antenna_color, outline=ROBOT_OUTLINE, width=4)
    canvas.rectangle(
        (center - 170, 196, center + 170, 440), head_color, radius=64, outline=ROBOT_OUTLINE, width=6
    )

    for eye_x in (center - 70, center + 70):
        canvas.ellipse((eye_x, 300), (50, 50), (255, 255, 255), outline=ROBOT_OUTLINE, width=5)
        canvas.ellipse((eye_x + 8, 306), (24, 24), ROBOT_DARK)
        canvas.ellipse((eye_x + 16, 296), (8, 8), (255, 255, 255))
        canvas.ellipse((eye_x + (-30 if eye_x < center else 30), 378), (22, 12), (246, 160, 170))
    canvas.arc((center - 56, 336, center + 56, 412), 20, 160, ROBOT_DARK, 8)
    save_image(canvas.finish(), path)


def draw_heart(canvas: SupersampledCanvas, center: Point, size: float, color: Color) -> None:
    x, y = center
    canvas.ellipse((x - size * 0.5, y - size * 0.25), (size * 0.55, size * 0.55), color)
    canvas.ellipse((x + size * 0.5, y - size * 0.25), (size * 0.55, size * 0.55), color)
    canvas.polygon(
        [(x - size * 1.02, y - size * 0.1), (x + size * 1.02, y - size * 0.1), (x, y + size * 1.1)], color
    )


# ---------------------------------------------------------------------------------------------------------------
# Ref2VA picture 2: a cafe interior (landscape)


WOOD_DARK = (104, 66, 42)
WOOD = (146, 96, 58)
WOOD_LIGHT = (176, 124, 80)
CUP = (250, 248, 240)


def draw_cafe(path: Path, *, width: int, height: int, wall_color: Color, sign_text: str) -> None:
    """A cafe seen from its seating area: window, chalkboard sign, counter with an espresso machine, lamps, a table."""
    canvas = SupersampledCanvas(width, height, wall_color)
    floor_top = 600

    canvas.rectangle((0, 470, width, floor_top), (170, 120, 82))
    for panel_x in range(20, width, 120):
        canvas.rectangle((panel_x, 488, panel_x + 96, floor_top - 18), None, outline=(140, 96, 62), width=4)
    for row, plank_top in enumerate(range(floor_top, height, 28)):
        canvas.rectangle((0, plank_top, width, plank_top + 28), WOOD if row % 2 else WOOD_LIGHT)
        for joint_x in range(90 + 130 * (row % 3), width, 390):
            canvas.line([(joint_x, plank_top), (joint_x, plank_top + 28)], WOOD_DARK, 2)

    draw_cafe_window(canvas, (60, 100, 360, 420))

    canvas.rectangle((630, 80, 970, 290), (40, 52, 46), radius=6, outline=WOOD_DARK, width=12)
    canvas.centered_text((800, 140), sign_text, 64, (246, 244, 232))
    for row, length in enumerate((180, 140, 200)):
        y = 200 + row * 28
        canvas.line([(690, y), (690 + length, y)], (196, 200, 190), 5)
        canvas.line([(900, y), (930, y)], (236, 200, 110), 5)

    canvas.rectangle((560, 418, width, floor_top), WOOD, outline=WOOD_DARK, width=4)
    for panel_x in range(584, width, 110):
        canvas.rectangle((panel_x, 444, panel_x + 86, floor_top - 20), None, outline=WOOD_DARK, width=3)
    canvas.rectangle((540, 400, width, 424), WOOD_DARK, radius=4)
    draw_espresso_machine(canvas, (780, 300, 930, 400))
    for cup_x in (600, 650, 700):
        draw_cup(canvas, (cup_x, 400), 16)
    canvas.ellipse((990, 372), (22, 28), (226, 120, 60))
    canvas.rectangle((972, 378, 1008, 400), (200, 90, 50), radius=6)

    for lamp_x, cord_length in ((220, 150), (480, 110)):
        canvas.line([(lamp_x, 0), (lamp_x, cord_length)], (50, 40, 36), 3)
        canvas.ellipse((lamp_x, cord_length + 34), (40, 22), (255, 232, 160))
        canvas.polygon(
            [
                (lamp_x - 16, cord_length),
                (lamp_x + 16, cord_length),
                (lamp_x + 46, cord_length + 34),
                (lamp_x - 46, cord_length + 34),
            ],
            (40, 92, 84),
        )

    draw_cafe_table(canvas, center_x=260, top_y=560)
    canvas.rectangle((488, 520, 538, 600), (196, 110, 72), radius=6)
    for dx, dy, radius in ((0, -70, 40), (-34, -40, 30), (34, -44, 32), (0, -110, 26)):
        canvas.ellipse((513 + dx, 520 + dy), (radius, radius), (70, 140, 80))
    save_image(canvas.finish(), path)


def draw_cafe_window(canvas: SupersampledCanvas, box: tuple[float, float, float, float]) -> None:
    left, top, right, bottom = box
    canvas.rectangle(box, (180, 220, 242))
    canvas.rectangle((left, bottom - 110, right, bottom), (150, 196, 150))
    canvas.rectangle((left + 30, bottom - 170, left + 110, bottom - 60), (210, 170, 150))
    canvas.rectangle((left + 170, bottom - 210, left + 240, bottom - 60), (190, 190, 212))
    canvas.line([(left + 236, bottom - 60), (left + 236, bottom - 150)], (110, 80, 60), 10)
    canvas.ellipse((left + 236, bottom - 180), (36, 42), (86, 160, 96))
    canvas.rectangle(box, None, outline=WOOD_DARK, width=14)
    canvas.line([((left + right) / 2, top), ((left + right) / 2, bottom)], WOOD_DARK, 10)
    canvas.line([(left, (top + bottom) / 2), (right, (top + bottom) / 2)], WOOD_DARK, 10)
    canvas.rectangle((left - 20, bottom, right + 20, bottom + 16), WOOD_DARK, radius=4)


def draw_espresso_machine(canvas: SupersampledCanvas, box: tuple[float, float, float, float]) -> None:
    left, top, right, bottom = box
    canvas.rectangle(box, (184, 190, 198), radius=10, outline=(90, 96, 106), width=4)
    canvas.rectangle((left + 14, top + 14, right - 14, top + 44), (120, 40, 44), radius=6)
    for spout_x in (left + 45, right - 45):
        canvas.rectangle((spout_x - 10, top + 54, spout_x + 10, top + 70), (70, 74, 82))
        draw_cup(canvas, (spout_x, bottom), 14)


def draw_cup(canvas: SupersampledCanvas, base: Point, size: float) -> None:
    x, y = base
    canvas.rectangle(
        (x - size, y - size * 1.6, x + size, y), CUP, radius=size * 0.3, outline=(150, 140, 130), width=2
    )
    canvas.arc((x + size * 0.6, y - size * 1.3, x + size * 1.6, y - size * 0.4), 270, 90, (150, 140, 130), 3)


def draw_cafe_table(canvas: SupersampledCanvas, *, center_x: float, top_y: float) -> None:
    for side in (-1, 1):
        chair_x = center_x + side * 150
        canvas.rectangle((chair_x - 8, top_y - 90, chair_x + 8, top_y + 150), WOOD_DARK)
        canvas.rectangle(
            (chair_x - 50 * (side < 0) - 8, top_y + 40, chair_x + 50 * (side > 0) + 8, top_y + 54), WOOD_DARK
        )
        canvas.line([(chair_x + side * 50, top_y + 54), (chair_x + side * 50, top_y + 150)], WOOD_DARK, 10)
    canvas.rectangle((center_x - 10, top_y + 10, center_x + 10, top_y + 140), (70, 60, 56))
    canvas.ellipse((center_x, top_y + 146), (60, 12), (70, 60, 56))
    canvas.ellipse((center_x, top_y), (130, 22), (236, 228, 214), outline=(160, 150, 140), width=3)
    draw_cup(canvas, (center_x - 40, top_y + 2), 14)
    draw_cup(canvas, (center_x + 44, top_y + 4), 14)


# ---------------------------------------------------------------------------------------------------------------
# Ref2VA video 1: a bouncing ball that rings a chime on every bounce


@dataclass(frozen=True)
class BallPath:
    """A ball crossing the stage left to right at constant speed, bouncing with a fixed period (pixels, s)."""

    seconds: float
    start_x: float
    end_x: float
    period: float
    first_impact: float
    drop_height: float

    def x(self, at_seconds: float) -> float:
        return self.start_x + (self.end_x - self.start_x) * at_seconds / self.seconds

    def lift(self, at_seconds: float) -> float:
        """Height of the ball's bottom above the floor: |sin| arcs that touch zero at each impact."""
        return self.drop_height * abs(math.sin(math.pi * (at_seconds - self.first_impact) / self.period))

    def last_impact(self, at_seconds: float) -> int:
        """Index of the latest impact at or before `at_seconds`, -1 before the first."""
        if at_seconds < self.first_impact:
            return -1
        return math.floor((at_seconds - self.first_impact) / self.period)

    def impact_seconds(self, index: int) -> float:
        return self.first_impact + index * self.period


STAGE_FLOOR = (176, 140, 108)
RING_SECONDS = 0.25


def make_bouncing_ball_video(
    path: Path,
    *,
    width: int,
    height: int,
    seconds: float,
    ball_radius: float,
    bounce_period: float,
    first_impact: float,
    drop_height: float,
    ball_colors: Sequence[Color],
    chime_notes_midi: Sequence[int],
) -> None:
    """A ball crossing a small stage left to right, bouncing; each impact changes its colour and rings a chime.

    The soundtrack is the chime melody alone (note i at impact i, equal-power panned to where the ball lands),
    so picture and sound agree frame by frame.
    """
    ball_path = BallPath(seconds, width * 0.1, width * 0.9, bounce_period, first_impact, drop_height)
    frames = np.stack(
        [
            draw_ball_frame(width, height, index / VIDEO_FPS, ball_path, ball_radius, ball_colors)
            for index in range(round(seconds * VIDEO_FPS))
        ]
    )

    soundtrack = np.zeros((2, round(seconds * SAMPLE_RATE)), dtype=np.float64)
    impact_count = ball_path.last_impact(seconds) + 1
    if impact_count > len(chime_notes_midi):
        raise ValueError(f"{impact_count} impacts need as many chime notes, got {len(chime_notes_midi)}")
    for impact in range(impact_count):
        landing_seconds = ball_path.impact_seconds(impact)
        pan = (ball_path.x(landing_seconds) - ball_path.start_x) / (ball_path.end_x - ball_path.start_x)
        add_chime(soundtrack, landing_seconds, chime_notes_midi[impact], pan)
    soundtrack *= 0.7 / np.abs(soundtrack).max()
    write_mp4(
        path, frames, soundtrack.astype(np.float32), fps=VIDEO_FPS, crf=VIDEO_CRF, audio_bitrate=AUDIO_BITRATE
    )


def draw_ball_frame(
    width: int,
    height: int,
    at_seconds: float,
    ball_path: BallPath,
    ball_radius: float,
    ball_colors: Sequence[Color],
) -> np.ndarray:
    """One [H, W, 3] uint8 frame: wall with a framed star, floor, landing ring, shadow, squashing ball."""
    wall_bottom, contact_y = height * 0.7, height * 0.84
    background = vertical_gradient(
        width, height, [(0.0, (196, 222, 236)), (0.7, (232, 242, 246)), (1.0, (232, 242, 246))]
    )
    canvas = SupersampledCanvas(width, height, background)
    canvas.rectangle((width * 0.42, 40, width * 0.58, 130), (250, 246, 236), outline=(150, 110, 80), width=6)
    draw_star(canvas, (width * 0.5, 86), 30, (250, 196, 60))
    canvas.rectangle((0, wall_bottom, width, height), STAGE_FLOOR)
    canvas.rectangle((0, wall_bottom - 10, width, wall_bottom), (120, 90, 66))

    impact = ball_path.last_impact(at_seconds)
    since_impact = at_seconds - ball_path.impact_seconds(impact)
    if impact >= 0 and since_impact < RING_SECONDS:
        spread = since_impact / RING_SECONDS
        ring_color = mix((255, 250, 220), STAGE_FLOOR, spread)
        landing_x = ball_path.x(ball_path.impact_seconds(impact))
        canvas.ellipse((landing_x, contact_y), (30 + 80 * spread, 8 + 16 * spread), None, ring_color, 4)

    lift = ball_path.lift(at_seconds)
    ball_x = ball_path.x(at_seconds)
    shadow_scale = 1 - 0.6 * lift / ball_path.drop_height
    canvas.ellipse((ball_x, contact_y), (ball_radius * shadow_scale, 7 * shadow_scale), (140, 108, 80))
    # Squash close to the floor: wider and flatter, the bottom kept on the floor.
    squash = max(0.0, 1 - lift / (ball_radius * 0.6)) * 0.22
    radius_x, radius_y = ball_radius * (1 + squash), ball_radius * (1 - squash)
    center = (ball_x, contact_y - lift - radius_y)
    color = ball_colors[(impact + 1) % len(ball_colors)]
    canvas.ellipse(center, (radius_x, radius_y), color, outline=(60, 50, 60), width=3)
    canvas.ellipse(
        (center[0] - radius_x * 0.35, center[1] - radius_y * 0.4),
        (radius_x * 0.22, radius_y * 0.16),
        mix(color, (255, 255, 255), 0.6),
    )
    return np.asarray(canvas.finish())


def draw_star(canvas: SupersampledCanvas, center: Point, radius: float, color: Color) -> None:
    points = []
    for corner in range(10):
        corner_radius = radius if corner % 2 == 0 else radius * 0.45
        angle = math.pi * corner / 5 - math.pi / 2
        points.append(
            (center[0] + corner_radius * math.cos(angle), center[1] + corner_radius * math.sin(angle))
        )
    canvas.polygon(points, color)


def add_chime(soundtrack: np.ndarray, start_seconds: float, midi_note: int, pan: float) -> None:
    """Add one bell-like note (slightly inharmonic partials, each with its own decay), equal-power panned."""
    frequency = 440.0 * 2 ** ((midi_note - 69) / 12)
    start = round(start_seconds * SAMPLE_RATE)
    length = min(round(1.5 * SAMPLE_RATE), soundtrack.shape[1] - start)
    t = np.arange(length, dtype=np.float64) / SAMPLE_RATE
    note = np.zeros(length, dtype=np.float64)
    for ratio, amplitude, decay_seconds in (
        (1.0, 1.0, 0.9),
        (2.0, 0.45, 0.5),
        (3.01, 0.25, 0.32),
        (4.17, 0.14, 0.2),
        (5.43, 0.08, 0.12),
    ):
        note += amplitude * np.exp(-t / decay_seconds) * np.sin(2 * np.pi * frequency * ratio * t)
    note *= np.minimum(t / 0.003, 1.0)
    angle = pan * math.pi / 2
    soundtrack[0, start : start + length] += math.cos(angle) * note
    soundtrack[1, start : start + length] += math.sin(angle) * note


# ---------------------------------------------------------------------------------------------------------------
# Ref2VA audio 1: a synthesized voice-like phrase


# First three formant frequencies (Hz) of the vowels the phrase uses.
VOWEL_FORMANTS = {
    "a": (730.0, 1090.0, 2440.0),
    "e": (530.0, 1840.0, 2480.0),
    "i": (300.0, 2250.0, 3000.0),
    "o": (570.0, 840.0, 2410.0),
    "u": (320.0, 870.0, 2240.0),
}
FORMANT_BANDWIDTHS = (90.0, 110.0, 150.0)
FORMANT_GAINS = (1.0, 0.6, 0.3)


def make_voice_clip(
    path: Path,
    *,
    seconds: float,
    syllables: Sequence[tuple[float, float, str, float, float]],
    vibrato_hz: float,
    echo_delays_seconds: tuple[float, float],
    echo_gain: float,
) -> None:
    """A wordless, speech-like phrase: glottal pulses at a gliding pitch exciting vowel formants.

    `syllables` holds (start s, length s, vowel, start pitch Hz, end pitch Hz). Each glottal pulse adds one
    impulse response of three damped resonances (the source-filter model of a vowel); a short echo, delayed
    differently per channel, makes the clip stereo. Written as 16-bit PCM at 32 kHz.
    """
    sample_count = round(seconds * SAMPLE_RATE)
    dry = np.zeros(sample_count, dtype=np.float64)
    response_t = np.arange(round(0.03 * SAMPLE_RATE), dtype=np.float64) / SAMPLE_RATE
    for start_seconds, length_seconds, vowel, pitch_start, pitch_end in syllables:
        response = sum(
            gain * np.exp(-math.pi * bandwidth * response_t) * np.sin(2 * math.pi * formant * response_t)
            for formant, bandwidth, gain in zip(
                VOWEL_FORMANTS[vowel], FORMANT_BANDWIDTHS, FORMANT_GAINS, strict=True
            )
        )
        pulse_seconds = start_seconds
        while pulse_seconds < start_seconds + length_seconds:
            progress = (pulse_seconds - start_seconds) / length_seconds
            pitch = (pitch_start + (pitch_end - pitch_start) * progress) * (
                1 + 0.015 * math.sin(2 * math.pi * vibrato_hz * pulse_seconds)
            )
            # Raised-cosine swell over the syllable so it starts and ends without clicks.
            loudness = 0.5 - 0.5 * math.cos(2 * math.pi * progress)
            start = round(pulse_seconds * SAMPLE_RATE)
            stop = min(start + response_t.size, sample_count)
            dry[start:stop] += loudness * response[: stop - start]
            pulse_seconds += 1 / pitch

    channels = []
    for delay_seconds in echo_delays_seconds:
        delay = round(delay_seconds * SAMPLE_RATE)
        channel = dry.copy()
        channel[delay:] += echo_gain * dry[: sample_count - delay]
        channels.append(channel)
    stereo = np.stack(channels)
    stereo *= WAV_PEAK / np.abs(stereo).max()
    write_wav_pcm16(path, stereo)


def write_wav_pcm16(path: Path, stereo: np.ndarray) -> None:
    """Write [2, N] floats in [-1, 1] as 16-bit little-endian PCM with the standard library (no metadata)."""
    samples = np.round(stereo.T * 32767).astype("<i2")
    with wave.open(str(path), "wb") as handle:
        handle.setnchannels(stereo.shape[0])
        handle.setsampwidth(2)
        handle.setframerate(SAMPLE_RATE)
        handle.writeframes(samples.tobytes())


# ---------------------------------------------------------------------------------------------------------------
# The recipe table: what is made, by which function, with which parameters


@dataclass(frozen=True)
class AssetRecipe:
    relative_path: str
    make: Callable[..., None]
    parameters: Mapping[str, Any]
    description: str
    file_format: str


SUNRISE_SIZE = {"width": 1344, "height": 768}
RECIPES = (
    AssetRecipe(
        "fl2va/first.png",
        draw_sunrise_keyframe,
        {
            **SUNRISE_SIZE,
            "daylight": 0.0,
            "sun_center": (900.0, 572.0),
            "sun_radius": 70.0,
            "kite_center": (430.0, 420.0),
            "kite_tilt_degrees": -14.0,
            "cloud_drift": 0.0,
        },
        "FL2VA first frame: dawn, the sun just rising behind the far hills, the red kite low on the left.",
        "PNG, 1344x768, RGB 8-bit",
    ),
    AssetRecipe(
        "fl2va/last.png",
        draw_sunrise_keyframe,
        {
            **SUNRISE_SIZE,
            "daylight": 1.0,
            "sun_center": (980.0, 230.0),
            "sun_radius": 62.0,
            "kite_center": (610.0, 215.0),
            "kite_tilt_degrees": 12.0,
            "cloud_drift": 60.0,
        },
        "FL2VA last frame: the same hills in morning light, the sun high, the kite high in the middle.",
        "PNG, 1344x768, RGB 8-bit",
    ),
    AssetRecipe(
        "ref2va/picture1.png",
        draw_robot,
        {
            "width": 768,
            "height": 1024,
            "body_color": (72, 176, 178),
            "head_color": (104, 200, 200),
            "antenna_color": (234, 70, 70),
        },
        "Ref2VA character: a small teal robot with round eyes and a red antenna ball, waving.",
        "PNG, 768x1024, RGB 8-bit",
    ),
    AssetRecipe(
        "ref2va/picture2.jpg",
        draw_cafe,
        {"width": 1024, "height": 768, "wall_color": (238, 224, 198), "sign_text": "CAFE"},
        "Ref2VA place: a cafe interior with a window, a chalkboard sign, a counter with an espresso machine, "
        "pendant lamps, a table with two chairs and a plant.",
        f"JPEG, 1024x768, RGB, quality {JPEG_QUALITY}, 4:2:0",
    ),
    AssetRecipe(
        "ref2va/video1.mp4",
        make_bouncing_ball_video,
        {
            "width": 640,
            "height": 360,
            "seconds": 3.0,
            "ball_radius": 26.0,
            "bounce_period": 0.75,
            "first_impact": 0.375,
            "drop_height": 170.0,
            "ball_colors": ((238, 92, 66), (250, 196, 60), (84, 178, 110), (80, 140, 230)),
            "chime_notes_midi": (72, 76, 79, 84),
        },
        "Ref2VA video with soundtrack: a ball bouncing across a small stage; each of its four bounces changes "
        "its colour and rings one chime note (C5, E5, G5, C6), panned to where it lands.",
        f"MP4: H.264 yuv420p 640x360 24 fps, 72 frames (CRF {VIDEO_CRF}); AAC-LC 32 kHz stereo "
        f"({AUDIO_BITRATE // 1000} kb/s)",
    ),
    AssetRecipe(
        "ref2va/audio1.wav",
        make_voice_clip,
        {
            "seconds": 3.0,
            "syllables": (
                (0.12, 0.22, "e", 150.0, 166.0),
                (0.36, 0.36, "o", 172.0, 128.0),
                (0.95, 0.22, "a", 146.0, 158.0),
                (1.19, 0.20, "i", 162.0, 150.0),
                (1.42, 0.22, "a", 150.0, 140.0),
                (1.66, 0.42, "o", 140.0, 112.0),
                (2.26, 0.20, "u", 148.0, 160.0),
                (2.48, 0.36, "a", 166.0, 196.0),
            ),
            "vibrato_hz": 5.5,
            "echo_delays_seconds": (0.09, 0.11),
            "echo_gain": 0.22,
        },
        "Ref2VA voice: a wordless, speech-like phrase (eight vowel syllables with a rising question at the "
        "end) from glottal pulses and three vowel formants; a short echo per channel makes it stereo.",
        "WAV, 16-bit PCM, 32 kHz, stereo, 3.000 s (96000 frames)",
    ),
)

# The MP4's bytes depend on the FFmpeg build; every other file is compared by sha256.
HASH_CHECKED_SUFFIXES = (".png", ".jpg", ".wav")


# ---------------------------------------------------------------------------------------------------------------
# Writing everything, and the provenance file


def make_all(output_folder: Path) -> dict[str, str]:
    """Make every asset under `output_folder` and write PROVENANCE.md there; return {relative path: sha256}."""
    hashes = {}
    for recipe in RECIPES:
        path = output_folder / recipe.relative_path
        path.parent.mkdir(parents=True, exist_ok=True)
        recipe.make(path, **recipe.parameters)
        hashes[recipe.relative_path] = sha256_of(path)
    (output_folder / "PROVENANCE.md").write_text(provenance_text(output_folder, hashes), encoding="utf-8")
    return hashes


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def provenance_text(output_folder: Path, hashes: Mapping[str, str]) -> str:
    libavcodec = ".".join(str(part) for part in av.library_versions["libavcodec"])
    lines = [
        "# Provenance of the bundled example inputs",
        "",
        "Generated by `assets/make_assets.py` (do not edit by hand; rerun `python assets/make_assets.py`).",
        "",
        "Every file below was made by this project, from code in `assets/make_assets.py`: shapes drawn with "
        "Pillow (the only text, the chalkboard's \"CAFE\", uses Pillow's built-in default font, the Aileron "
        "Regular subset embedded in Pillow, a CC0 font), sound "
        "synthesized with numpy, the MP4 encoded with PyAV through `h3engine.media.mux.write_mp4`. No file was "
        "downloaded and no third-party media, photograph, recording or font file was used.",
        "",
        "License: made by this project; distributed under the same license as the rest of this repository.",
        "",
        f"Made with Python {sys.version_info.major}.{sys.version_info.minor}, Pillow {PIL.__version__}, "
        f"numpy {np.__version__}, PyAV {av.__version__} (libavcodec {libavcodec}). PNG, JPEG and WAV bytes are "
        "reproducible with the same Pillow build (tests/test_assets.py regenerates them and compares the "
        "sha256 values below); the MP4's bytes depend on the FFmpeg build (x264, AAC encoder), so its stream "
        "properties are checked instead of its hash.",
        "",
    ]
    for recipe in RECIPES:
        parameters = json.dumps(recipe.parameters, separators=(", ", ": "))
        lines += [
            f"### `assets/{recipe.relative_path}`",
            "",
            f"- What: {recipe.description}",
            f"- Made by: `{recipe.make.__name__}` in `assets/make_assets.py` with parameters `{parameters}`",
            f"- Format: {recipe.file_format}",
        ]
        if recipe.relative_path.endswith(".mp4"):
            lines.append(f"- Probed: {mp4_summary(output_folder / recipe.relative_path)}")
        lines += [
            "- License: made by this project, same license as the repository",
            f"- sha256: `{hashes[recipe.relative_path]}`"
            + (
                ""
                if recipe.relative_path.endswith(HASH_CHECKED_SUFFIXES)
                else " (this build's bytes; not checked)"
            ),
            "",
        ]
    return "\n".join(lines)


def mp4_summary(path: Path) -> str:
    facts = probe_mp4(path)
    return (
        f"{facts['video_codec']} {facts['pix_fmt']} {facts['width']}x{facts['height']} {facts['fps']:g} fps "
        f"{facts['frame_count']} frames; {facts['audio_codec']} {facts['audio_sample_rate']} Hz "
        f"{facts['audio_channels']} ch, {facts['audio_duration_s']:.3f} s"
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=ASSETS_FOLDER, help="folder to write into (default: assets/)"
    )
    arguments = parser.parse_args(argv)
    for relative_path, digest in make_all(arguments.out).items():
        print(f"{digest}  {relative_path}")


if __name__ == "__main__":
    main()
