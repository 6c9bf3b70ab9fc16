"""Look closer: read a tiny code in one cell of a grid image with a ``zoom`` tool.

The prompt image is a grid (columns A, B, ..., rows 1, 2, ..., with large labels) in which every
cell holds a short code of letters and digits drawn in a small font (``font_px`` pixels), too small
to read at full view. The task asks for the code of one cell. The ``zoom`` tool crops a region (a
cell name such as ``"B3"``, or a pixel box ``[x0, y0, x1, y1]`` of the full image) and returns it
enlarged ``zoom_factor`` times, as an image in the tool message. The final answer is
``<answer>CODE</answer>``; reward 1.0 when it is the cell's code (case and spaces ignored), else 0.0.

Rows (``ZoomEnv.dataset``) hold the codes and the seed of the drawing (colors, positions), so the
image is redrawn identically from the row and the row stays plain JSON.
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass
from typing import Any

from turnrl.env.builtin.frozen_lake import with_image
from turnrl.env.builtin.key_lookup import answer_of
from turnrl.env.builtin.math_tools import last_model_text
from turnrl.env.tool_env import ToolEnv
from turnrl.tools import FunctionTool, ToolArgumentError, ToolOutput
from turnrl.tools.parsers import ToolParser
from turnrl.types import Message, Sample, Trajectory

SYSTEM_PROMPT = (
    "You read small text in images. The zoom tool shows a region of the image enlarged; call it "
    "exactly like this:\n"
    '<tool_call>{"name": "zoom", "arguments": {"cell": "B3"}}</tool_call>\n'
    'or with a pixel box of the full image: {"bbox": [x0, y0, x1, y1]}. '
    "When you can read the code, reply with it as <answer>CODE</answer>."
)
CODE_CHARS = "".join(c for c in string.ascii_uppercase + string.digits if c not in "O0I1L")
_LABEL_PX = 24  # labels of rows and columns: readable at full view
CELL_PX = 160


@dataclass(frozen=True)
class Layout:
    """Where the cells are: a margin for the labels, then ``rows`` x ``cols`` square cells."""

    rows: int
    cols: int
    cell_px: int
    margin_px: int = 32

    @property
    def size(self) -> tuple[int, int]:
        """(width, height) of the image."""
        return self.margin_px + self.cols * self.cell_px, self.margin_px + self.rows * self.cell_px

    def cell_name(self, row: int, col: int) -> str:
        """``"B3"`` for row 2 (0-based), column 1 (0-based)."""
        return f"{string.ascii_uppercase[col]}{row + 1}"

    def cell_box(self, name: str) -> tuple[int, int, int, int]:
        """The pixel box ``(x0, y0, x1, y1)`` of a cell name such as ``"B3"`` (any case)."""
        name = name.strip().upper()
        col = string.ascii_uppercase.find(name[:1]) if name else -1
        row = int(name[1:]) - 1 if name[1:].isdigit() else -1
        if not (0 <= col < self.cols and 0 <= row < self.rows):
            last = self.cell_name(self.rows - 1, self.cols - 1)
            raise ToolArgumentError(f"no cell {name!r}: cells go from A1 to {last}")
        x0, y0 = self.margin_px + col * self.cell_px, self.margin_px + row * self.cell_px
        return x0, y0, x0 + self.cell_px, y0 + self.cell_px


def draw_grid(codes: list[list[str]], seed: int, cell_px: int = CELL_PX, font_px: int = 8) -> Any:
    """The grid image (PIL, RGB): labels, cell borders, each code in a random dark color at a
    random spot of its cell, all drawn from ``seed``."""
    from PIL import Image, ImageDraw, ImageFont

    layout = Layout(len(codes), len(codes[0]), cell_px)
    rng = random.Random(seed)
    image = Image.new("RGB", layout.size, (250, 250, 245))
    draw = ImageDraw.Draw(image)
    label_font = ImageFont.load_default(size=_LABEL_PX)
    code_font = ImageFont.load_default(size=font_px)
    m = layout.margin_px
    for col in range(layout.cols):
        draw.text(
            (m + (col + 0.5) * cell_px, m / 2), string.ascii_uppercase[col], (0, 0, 0), label_font, "mm"
        )
    for row in range(layout.rows):
        draw.text((m / 2, m + (row + 0.5) * cell_px), str(row + 1), (0, 0, 0), label_font, "mm")
    for row, line in enumerate(codes):
        for col, code in enumerate(line):
            x0, y0, x1, y1 = layout.cell_box(layout.cell_name(row, col))
            draw.rectangle((x0, y0, x1, y1), outline=(160, 160, 160))
            w, h = (int(v) for v in draw.textbbox((0, 0), code, font=code_font)[2:])
            color = (rng.randrange(160), rng.randrange(160), rng.randrange(160))
            at = (rng.randrange(x0 + 4, x1 - 4 - w), rng.randrange(y0 + 4, y1 - 4 - h))
            draw.text(at, code, color, code_font)
    return image


def zoom_tool(image: Any, layout: Layout, factor: int = 3) -> FunctionTool:
    """The ``zoom`` tool over one image."""
    width, height = image.size

    def zoom(cell: str | None = None, bbox: list[int] | None = None) -> ToolOutput:
        """Show a region of the image enlarged: a cell of the grid, or a pixel box of the full image.

        Args:
            cell: A cell name, e.g. "B3" (column letter, row number).
            bbox: A box [x0, y0, x1, y1] in pixels of the full image, used when no cell is given.
        """
        if cell:
            box, where = layout.cell_box(cell), f"cell {cell.strip().upper()}"
        elif bbox is not None and len(bbox) == 4:
            x0, y0, x1, y1 = (int(v) for v in bbox)
            box = (max(0, x0), max(0, y0), min(width, x1), min(height, y1))
            if box[2] - box[0] < 4 or box[3] - box[1] < 4:
                raise ToolArgumentError(f"bbox {bbox} is empty inside the {width}x{height} image")
            where = f"box {list(box)}"
        else:
            raise ToolArgumentError('give a cell name ("B3") or a bbox [x0, y0, x1, y1]')
        crop = image.crop(box)
        crop = crop.resize((crop.width * factor, crop.height * factor), resample=3)  # bicubic
        return ToolOutput(f"{where}, enlarged {factor}x.", images=[crop])

    return FunctionTool(zoom)


class ZoomEnv(ToolEnv):
    """Find the code of one cell; zoom in with the ``zoom`` tool, answer with ``<answer>``."""

    def __init__(self, sample: Sample, parser: str | ToolParser = "hermes", zoom_factor: int = 3) -> None:
        meta = sample.metadata
        self.codes: list[list[str]] = [list(line) for line in meta["codes"]]
        self.answer = str(meta["answer"])
        cell_px, font_px = int(meta.get("cell_px", CELL_PX)), int(meta.get("font_px", 8))
        self.layout = Layout(len(self.codes), len(self.codes[0]), cell_px)
        self.image = draw_grid(self.codes, int(meta["image_seed"]), cell_px, font_px)
        super().__init__(sample, [zoom_tool(self.image, self.layout, zoom_factor)], parser=parser)

    async def reset(self) -> list[Message]:
        """The row's prompt with the grid image in its last user message."""
        return with_image(await super().reset(), self.image)

    async def score(self, trajectory: Trajectory) -> float:
        """1.0 when the last model turn's ``<answer>`` is the code (case and spaces ignored)."""
        answer = answer_of(last_model_text(trajectory))
        return float(answer is not None and _norm(answer) == _norm(self.answer))

    @staticmethod
    def dataset(
        size: int = 8, seed: int = 0, rows: int = 4, cols: int = 4, code_len: int = 3, font_px: int = 8
    ) -> list[dict[str, Any]]:
        """``size`` grids of ``rows`` x ``cols`` random codes, each asking for one cell."""
        rng = random.Random(seed)
        return [_row(rng, i, seed, rows, cols, code_len, font_px) for i in range(size)]


def _norm(text: str) -> str:
    return "".join(text.split()).casefold()


def _row(
    rng: random.Random, index: int, seed: int, rows: int, cols: int, code_len: int, font_px: int
) -> dict[str, Any]:
    codes = [["".join(rng.choices(CODE_CHARS, k=code_len)) for _ in range(cols)] for _ in range(rows)]
    row, col = rng.randrange(rows), rng.randrange(cols)
    layout = Layout(rows, cols, CELL_PX)
    width, height = layout.size
    prompt: list[Message] = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {
            "role": "user",
            "content": f"The image ({width}x{height} pixels) is a grid with columns A-"
            f"{string.ascii_uppercase[cols - 1]} and rows 1-{rows}; each cell holds a {code_len}-character "
            f"code. What is written in cell {layout.cell_name(row, col)}?",
        },
    ]
    return {
        "id": f"zoom/{seed}/{index}",
        "prompt": prompt,
        "data_source": "zoom",
        "codes": codes,
        "cell": layout.cell_name(row, col),
        "answer": codes[row][col],
        "image_seed": rng.getrandbits(31),
        "cell_px": CELL_PX,
        "font_px": font_px,
    }
