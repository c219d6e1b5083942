"""Token layout of the joint sequence and its rotary positions, computed once per generation.

The transformer sees one sequence: the prompt's tokens with each condition image's latent tokens in
place of its <|image_pad|> slots (one slot = 2x2 latent tokens, dropped in raster order), then the
target image's latent tokens. Everything before the target is the *prefix*: it never attends to the
target and is modulated from t=0, so its K/V are the same at every denoising step.

All of this is host-side bookkeeping from shapes and the slot mask, done once so that no denoising
step pays for it (the reference rebuilds it, with device syncs, on every call).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TOKENS_PER_SLOT = 4  # each <|image_pad|> slot stands for a 2x2 group of latent tokens
ROPE_THETA = 10000.0
ROPE_MAX_POSITION = 8191  # the reference's tables hold positions 0..8191 ...
ROPE_MIN_POSITION = -1024  # ... and -1024..-1; anything else would alias silently


@dataclass(frozen=True)
class Segment:
    """A run of prefix tokens that attend the same way: a text run (causal) or one image block."""

    start: int
    end: int
    is_text: bool


@dataclass
class SequenceLayout:
    """Where every token of the joint sequence comes from and where it sits.

    prefix_len / target_len:  token counts; the joint sequence is [prefix | target].
    text_source:    [T] long, for each prefix text token (in joint order) its index in the prompt.
    text_rows:      [T] long, the joint positions of those text tokens.
    image_rows:     [I] long, the joint positions of the condition-image tokens, in the order of the
                    concatenated condition latents (image 0 raster order, then image 1, ...).
    segments:       the prefix split into text runs and image blocks (block-causal attention).
    positions:      [prefix_len + target_len, 3] long (frame, height, width) rotary positions.
    key_valid:      [prefix_len] bool or None; False at padded prompt tokens (never attended to).
    """

    prefix_len: int
    target_len: int
    target_shape: tuple[int, int]
    text_source: torch.Tensor
    text_rows: torch.Tensor
    image_rows: torch.Tensor
    segments: tuple[Segment, ...]
    positions: torch.Tensor
    key_valid: torch.Tensor | None = None

    @property
    def total_len(self) -> int:
        return self.prefix_len + self.target_len


def build_layout(
    image_pad_mask: torch.Tensor,
    condition_shapes: list[tuple[int, int]],
    target_shape: tuple[int, int],
    text_valid: torch.Tensor | None = None,
) -> SequenceLayout:
    """Lay out one prompt with its condition images and the target.

    image_pad_mask:    [L] bool over the prompt tokens, True at image slots.
    condition_shapes:  latent grid (h, w) of each condition image, in slot order.
    target_shape:      latent grid (h, w) of the output image.
    text_valid:        optional [L] bool, False at padded prompt positions (batched reference prompts).
    """
    slot_mask = image_pad_mask.detach().to("cpu", torch.bool).reshape(-1).tolist()
    slots_needed = []
    for h, w in condition_shapes:
        if (h * w) % TOKENS_PER_SLOT:
            raise ValueError(f"condition latent grid {h}x{w} is not a whole number of 2x2 slots")
        slots_needed.append(h * w // TOKENS_PER_SLOT)
    if sum(slot_mask) != sum(slots_needed):
        raise ValueError(
            f"the prompt has {sum(slot_mask)} image slots but the condition images need {sum(slots_needed)} "
            f"(latent grids {condition_shapes}, one slot per 2x2 latent tokens)"
        )
    th, tw = target_shape
    if th <= 0 or tw <= 0:
        raise ValueError(f"target latent grid must be positive, got {th}x{tw}")

    # Walk the prompt: text tokens take one row each, every slot expands to four image rows.
    text_source, text_rows, image_rows, image_ids = [], [], [], []
    block_of_slot = [index for index, count in enumerate(slots_needed) for _ in range(count)]
    slot_index = 0
    for prompt_index, is_slot in enumerate(slot_mask):
        row = len(image_ids)
        if is_slot:
            image_rows.extend(range(row, row + TOKENS_PER_SLOT))
            image_ids.extend([block_of_slot[slot_index]] * TOKENS_PER_SLOT)
            slot_index += 1
        else:
            text_source.append(prompt_index)
            text_rows.append(row)
            image_ids.append(-1)
    prefix_len = len(image_ids)

    segments = []
    start = 0
    for index in range(1, prefix_len + 1):
        if index == prefix_len or image_ids[index] != image_ids[start]:
            segments.append(Segment(start, index, image_ids[start] < 0))
            start = index

    positions = _rotary_positions(image_ids, condition_shapes, target_shape)

    key_valid = None
    if text_valid is not None:
        valid = text_valid.detach().to("cpu", torch.bool).reshape(-1)
        if valid.shape[0] != len(slot_mask):
            raise ValueError(f"text_valid has {valid.shape[0]} entries, the prompt has {len(slot_mask)} tokens")
        if not bool(valid.all()):
            key_valid = torch.ones(prefix_len, dtype=torch.bool)
            key_valid[torch.tensor(text_rows, dtype=torch.long)] = valid[torch.tensor(text_source, dtype=torch.long)]

    return SequenceLayout(
        prefix_len=prefix_len,
        target_len=th * tw,
        target_shape=(th, tw),
        text_source=torch.tensor(text_source, dtype=torch.long),
        text_rows=torch.tensor(text_rows, dtype=torch.long),
        image_rows=torch.tensor(image_rows, dtype=torch.long),
        segments=tuple(segments),
        positions=positions,
        key_valid=key_valid,
    )


def _centred(n: int) -> range:
    return range(-(n - n // 2), n // 2)


def _rotary_positions(image_ids, condition_shapes, target_shape) -> torch.Tensor:
    """(frame, h, w) per token, as the reference assigns them.

    Text advances one shared position on all three axes (padded tokens included). An image block
    freezes the frame at the current position, lays h/w out on a grid centred on zero, then moves the
    position on by max(h, w).
    """
    shapes = [*condition_shapes, target_shape]
    rows = []
    position = 0
    index = 0
    for block, (h, w) in enumerate(shapes):
        # text before this block
        while index < len(image_ids) and image_ids[index] != block:
            rows.append((position, position, position))
            position += 1
            index += 1
        rows.extend((position, hh, ww) for hh in _centred(h) for ww in _centred(w))
        index += h * w
        position += max(h, w)
    positions = torch.tensor(rows, dtype=torch.long)
    check_rotary_range(int(positions.min()), int(positions.max()), len(image_ids))
    return positions


def prefix_rotary_range(text_tokens: int, condition_shapes) -> tuple[int, int]:
    """(lowest, highest) rotary position a prompt of `text_tokens` text tokens and condition images with latent
    grids `condition_shapes` [(h, w), ...] lead to, the target's frame axis included, without laying the sequence
    out (as _rotary_positions assigns them: text advances one position, an image block max(h, w), its h/w axes
    centred on zero; the target then sits at the position reached). The encoder checks this before any model runs.
    """
    sides = [side for shape in condition_shapes for side in shape]
    frame = text_tokens + sum(max(h, w) for h, w in condition_shapes)
    return min([0, *(-(n - n // 2) for n in sides)]), max([frame, *(n // 2 - 1 for n in sides)])


def check_rotary_range(low: int, high: int, prefix_tokens: int) -> None:
    """Refuse positions outside the rotary table (they would alias silently), saying what to shorten."""
    if low < ROPE_MIN_POSITION or high > ROPE_MAX_POSITION:
        raise ValueError(
            f"rotary position {high if high > ROPE_MAX_POSITION else low} is outside the model's table "
            f"({ROPE_MIN_POSITION}..{ROPE_MAX_POSITION}): the prompt and condition images are too long "
            f"({prefix_tokens} prefix tokens); use a shorter prompt, fewer or smaller condition images"
        )


def rotary_cos_sin(positions: torch.Tensor, axes_dims: tuple[int, ...], device=None):
    """cos/sin [S, head_dim/2] fp32 for (frame, h, w) positions [S, 3].

    Pair i of the head dim rotates by position[axis] / theta^(2j/d_axis), axes laid out
    [frame | height | width]. Computed on the CPU in fp32 so the result does not depend on the device.
    """
    angles = []
    for axis, dim in enumerate(axes_dims):
        inv_freq = 1.0 / torch.pow(ROPE_THETA, torch.arange(0, dim, 2, dtype=torch.float32).div(dim))
        angles.append(positions[:, axis].to(torch.float32)[:, None] * inv_freq[None, :])
    angle = torch.cat(angles, dim=1)
    return torch.cos(angle).to(device), torch.sin(angle).to(device)
