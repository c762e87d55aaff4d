"""Text side of preprocessing: tokenize, render chats, expand placeholders (detokenize.py:
the reverse; chat.py: the message checks and the template's environment).

A checkpoint directory supplies ``tokenizer.json`` (a byte-level BPE, loaded with the
``tokenizers`` library) and a chat template (``chat_template.jinja``, else the
``chat_template`` key of ``tokenizer_config.json``, else ``chat_template.json``).

The rendered prompt holds one ``<|image_pad|>`` per image; ``expand_image_placeholders``
repeats each one to the image's merged-token count and reports where each image's run
of placeholders sits (its span).

``encode_chat`` is the tokenization to use on untrusted chats: only the template's own
special-token markers become special tokens; special-token text inside the messages'
texts (a typed ``<|im_start|>`` or ``<|image_pad|>``) is tokenized as plain text, so a
user cannot forge turns or image placeholders. It equals ``encode(render_chat(...))``
whenever the texts hold no special-token strings.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
import msgspec
from tokenizers import Tokenizer

from services.common.errors import InvalidRequestError, ModelLoadError
from services.engine.processing.chat import (
    TEMPLATE_KWARGS_PARAM,
    TEXT_SENTINEL_RE,
    check_template_kwargs,
    compile_chat_template,
    find_chat_template,
    mask_message_texts,
    read_json,
    template_variables,
    text_sentinel,
    validate_messages,
)
from services.engine.processing.detokenize import IncrementalDetokenizer, token_bytes_table
from services.engine.processing.token_bound import TokenBound

IMAGE_TOKEN = "<|image_pad|>"
VIDEO_TOKEN = "<|video_pad|>"
VISION_START_TOKEN = "<|vision_start|>"
VISION_END_TOKEN = "<|vision_end|>"


class PlaceholderSpan(msgspec.Struct, frozen=True):
    """A run of placeholder tokens standing for one image, in expanded prompt positions."""

    offset: int  # index of the first placeholder token
    length: int  # number of placeholder tokens (the image's merged-token count)


def prompt_too_long(
    num_tokens: int, max_len: int, param: str, *, at_least: bool = False
) -> InvalidRequestError:
    """The error for a prompt of ``num_tokens`` (or more, ``at_least``) tokens: a prompt
    must be shorter than ``max_len``."""
    qualifier = "at least " if at_least else ""
    return InvalidRequestError(
        f"prompt has {qualifier}{num_tokens} tokens; the context limit is {max_len}", param=param
    )


# ---------------------------------------------------------------- placeholders


def expand_image_placeholders(
    token_ids: Sequence[int], image_token_id: int, num_image_tokens: Sequence[int]
) -> tuple[list[int], list[PlaceholderSpan]]:
    """Repeat the i-th single placeholder ``num_image_tokens[i]`` times; return ids and spans."""
    positions = [i for i, token_id in enumerate(token_ids) if token_id == image_token_id]
    if len(positions) != len(num_image_tokens):
        raise InvalidRequestError(
            f"the prompt has {len(positions)} image placeholders but {len(num_image_tokens)} images",
            param="messages",
        )
    expanded: list[int] = []
    spans: list[PlaceholderSpan] = []
    start = 0
    for position, num_tokens in zip(positions, num_image_tokens, strict=True):
        assert num_tokens > 0, num_tokens
        expanded.extend(token_ids[start:position])
        spans.append(PlaceholderSpan(offset=len(expanded), length=num_tokens))
        expanded.extend([image_token_id] * num_tokens)
        start = position + 1
    expanded.extend(token_ids[start:])
    return expanded, spans


def _token_content(value: Any) -> str | None:
    return value.get("content") if isinstance(value, Mapping) else value


def _eos_token_ids(
    tokenizer: Tokenizer, model_dir: Path, tokenizer_config: Mapping[str, Any]
) -> tuple[int, ...]:
    ids: set[int] = set()
    eos_token = _token_content(tokenizer_config.get("eos_token"))
    if eos_token is not None and tokenizer.token_to_id(eos_token) is not None:
        ids.add(tokenizer.token_to_id(eos_token))
    generation_eos = read_json(model_dir / "generation_config.json").get("eos_token_id")
    if isinstance(generation_eos, int):
        ids.add(generation_eos)
    elif isinstance(generation_eos, list):
        ids.update(generation_eos)
    if not ids:
        raise ModelLoadError(
            f"{model_dir} names no eos token (tokenizer_config.json or generation_config.json)"
        )
    return tuple(sorted(ids))


class TextProcessor:
    """Chat template, tokenizer and detokenizer of one checkpoint directory."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        chat_template: str,
        eos_token_ids: Sequence[int],
        special_tokens_map: Mapping[str, str] | None = None,
    ) -> None:
        self._tokenizer = tokenizer
        self._template = compile_chat_template(chat_template)
        self._template_source = chat_template
        self._special_tokens_map = dict(special_tokens_map or {})
        self.eos_token_ids: tuple[int, ...] = tuple(eos_token_ids)
        self.image_token_id = self._required_token_id(IMAGE_TOKEN)
        self.vision_start_token_id = self._required_token_id(VISION_START_TOKEN)
        self.vision_end_token_id = self._required_token_id(VISION_END_TOKEN)
        self.video_token_id = tokenizer.token_to_id(VIDEO_TOKEN)
        self.special_token_ids = frozenset(
            token_id
            for token_id, added in tokenizer.get_added_tokens_decoder().items()
            if added.special
        )
        self._token_bytes = token_bytes_table(tokenizer)
        self._bound = TokenBound.from_tokenizer(tokenizer, self._token_bytes)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> TextProcessor:
        model_dir = Path(model_dir)
        tokenizer_path = model_dir / "tokenizer.json"
        if not tokenizer_path.is_file():
            raise ModelLoadError(f"{tokenizer_path} does not exist")
        tokenizer = Tokenizer.from_file(str(tokenizer_path))
        decoder_type = (
            json.loads(tokenizer_path.read_text(encoding="utf-8")).get("decoder", {}).get("type")
        )
        if decoder_type != "ByteLevel":
            raise ModelLoadError(
                f"{tokenizer_path}: only byte-level BPE tokenizers are supported, got {decoder_type}"
            )
        config = read_json(model_dir / "tokenizer_config.json")
        special_tokens_map = {
            key: content
            for key in ("bos_token", "eos_token", "pad_token", "unk_token")
            if (content := _token_content(config.get(key))) is not None
        }
        return cls(
            tokenizer,
            find_chat_template(model_dir, config),
            _eos_token_ids(tokenizer, model_dir, config),
            special_tokens_map,
        )

    def _required_token_id(self, token: str) -> int:
        token_id = self._tokenizer.token_to_id(token)
        if token_id is None:
            raise ModelLoadError(f"tokenizer has no {token} token")
        return token_id

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def template_variables(self) -> frozenset[str]:
        """The variables the chat template reads (``chat.template_variables``): the names a
        request's ``template_kwargs`` may set."""
        return template_variables(self._template, self._template_source)

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        *,
        continue_final_message: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text of a chat: one image placeholder per image part.

        ``continue_final_message`` (vLLM's, with ``add_generation_prompt`` false): the last
        message, an assistant one ending in text, is left open: the text ends right after
        that message's text, without the end of its turn, so the model continues it.
        ``template_kwargs``: extra variables for the template (vLLM's
        ``chat_template_kwargs``), checked by ``check_template_kwargs``; each must be one
        the template reads (``template_variables``). Errors are ``InvalidRequestError``s
        naming the field."""
        validate_messages(messages)
        if not continue_final_message:
            return self._render(messages, add_generation_prompt, template_kwargs)
        masked, texts = mask_message_texts(messages)
        rendered = self._render_masked(
            masked, len(texts), add_generation_prompt, True, template_kwargs
        )
        return TEXT_SENTINEL_RE.sub(lambda m: texts[int(m.group(1))], rendered)

    def _render(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool,
        template_kwargs: Mapping[str, Any] | None,
    ) -> str:
        kwargs = dict(template_kwargs or {})
        if kwargs:
            check_template_kwargs(kwargs)
            unread = sorted(set(kwargs) - self.template_variables)
            if unread:
                raise InvalidRequestError(
                    f"this model's chat template does not read {unread[0]!r}; "
                    f"{TEMPLATE_KWARGS_PARAM} takes only variables it reads, so none is ignored",
                    param=f"{TEMPLATE_KWARGS_PARAM}.{unread[0]}",
                )
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                **self._special_tokens_map,
                **kwargs,
            )
        except jinja2.exceptions.TemplateError as e:
            raise InvalidRequestError(
                f"chat template rejected the messages: {e}", param="messages"
            ) from e

    def _render_masked(
        self,
        masked: Sequence[Mapping[str, Any]],
        num_texts: int,
        add_generation_prompt: bool,
        continue_final_message: bool,
        template_kwargs: Mapping[str, Any] | None,
    ) -> str:
        """The rendered text of ``masked`` (``mask_message_texts``' messages, ``num_texts``
        texts), cut after the last message's text when ``continue_final_message``."""
        if not continue_final_message:
            return self._render(masked, add_generation_prompt, template_kwargs)
        if add_generation_prompt:
            raise InvalidRequestError(
                "continue_final_message continues the last message, add_generation_prompt "
                "starts a new one: both cannot be true (set add_generation_prompt to false)",
                param="continue_final_message",
            )
        final = masked[-1]
        content = final["content"]
        if final["role"] != "assistant":
            raise InvalidRequestError(
                "continue_final_message continues the last message, which must be an assistant "
                f"message; it is a {final['role']} message",
                param="continue_final_message",
            )
        if not isinstance(content, str) and (not content or content[-1].get("type") != "text"):
            raise InvalidRequestError(
                "continue_final_message needs the last message to end with text",
                param="continue_final_message",
            )
        rendered = self._render(masked, False, template_kwargs)
        sentinel = text_sentinel(num_texts - 1)  # the last message's last text
        end = rendered.rfind(sentinel)
        if end < 0:
            raise InvalidRequestError(
                "the chat template does not write the last message's text, so it cannot be "
                "continued",
                param="continue_final_message",
            )
        return rendered[: end + len(sentinel)]

    def encode(self, text: str, max_len: int | None = None) -> list[int]:
        """Token ids of a text, special-token strings parsed. With ``max_len``: raises
        InvalidRequestError (param ``prompt``) unless it is shorter, after work bounded
        by ``max_len`` however long the text is."""
        return self._encode_pieces([text], self._tokenizer, max_len, "prompt")

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        max_len: int | None = None,
        *,
        continue_final_message: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of a chat where only the template's markers are special tokens.

        The template renders with sentinels in place of the messages' texts; the result
        is split at its special-token markers (which the tokenizer also always splits
        at, so no BPE merge crosses a split point), and each piece between markers, its
        texts put back, is encoded with special-token matching off. Equal to
        ``encode(render_chat(messages))`` when no text holds a special-token string;
        otherwise such strings become plain-text tokens. Assumes the template writes
        message texts verbatim (Qwen2.5-VL's does). ``max_len`` as for ``encode``
        (param ``messages``); ``continue_final_message`` and ``template_kwargs`` as for
        ``render_chat`` (the last message's text is found by its sentinel, so the cut is
        exact whatever the text).
        """
        validate_messages(messages)
        masked, texts = mask_message_texts(messages)
        rendered = self._render_masked(
            masked, len(texts), add_generation_prompt, continue_final_message, template_kwargs
        )
        marker_re, marker_ids = self._special_markers
        pieces: list[str | int] = []
        for i, piece in enumerate(
            marker_re.split(rendered) if marker_re is not None else [rendered]
        ):
            if i % 2:  # a captured marker
                pieces.append(marker_ids[piece])
            elif piece:
                pieces.append(TEXT_SENTINEL_RE.sub(lambda m: texts[int(m.group(1))], piece))
        return self._encode_pieces(pieces, self._plain_tokenizer, max_len, "messages")

    def _encode_pieces(
        self, pieces: Sequence[str | int], tokenizer: Tokenizer, max_len: int | None, param: str
    ) -> list[int]:
        # The one place the context limit is applied to text: early when the bound proves
        # the prompt too long, else on the exact ids.
        if max_len is not None:
            count = self._bound.count_until(pieces, tokenizer, max_len)
            if count is not None and count.num_tokens >= max_len:
                raise prompt_too_long(count.num_tokens, max_len, param, at_least=not count.is_exact)
        ids: list[int] = []
        for piece in pieces:
            if isinstance(piece, int):
                ids.append(piece)
            else:
                ids.extend(tokenizer.encode(piece, add_special_tokens=False).ids)
        if max_len is not None and len(ids) >= max_len:
            raise prompt_too_long(len(ids), max_len, param)
        return ids

    @functools.cached_property
    def _plain_tokenizer(self) -> Tokenizer:
        # A copy that tokenizes special-token strings as text (non-special added tokens still match).
        plain = Tokenizer.from_str(self._tokenizer.to_str())
        plain.encode_special_tokens = True
        return plain

    @functools.cached_property
    def _special_markers(self) -> tuple[re.Pattern[str] | None, dict[str, int]]:
        # Leftmost-longest match of special-token strings, as the tokenizer matches them.
        ids = {
            added.content: token_id
            for token_id, added in self._tokenizer.get_added_tokens_decoder().items()
            if added.special
        }
        if not ids:
            return None, ids
        alternatives = "|".join(
            re.escape(content) for content in sorted(ids, key=len, reverse=True)
        )
        return re.compile(f"({alternatives})"), ids

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes ``token_id`` stands for (a piece of UTF-8 text); b"" outside the vocabulary."""
        if not 0 <= token_id < len(self._token_bytes):
            return b""
        return self._token_bytes[token_id]

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def expand_image_placeholders(
        self, token_ids: Sequence[int], num_image_tokens: Sequence[int]
    ) -> tuple[list[int], list[PlaceholderSpan]]:
        return expand_image_placeholders(token_ids, self.image_token_id, num_image_tokens)

    def detokenizer(self, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(
            self._token_bytes, self.special_token_ids, skip_special_tokens
        )
