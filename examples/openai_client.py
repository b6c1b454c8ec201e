#!/usr/bin/env python3
"""Call a model served as a gpumarket service through its endpoint, with the ``openai`` package.

A service's endpoint is ``<master>/svc/<service_id>/``; its model server answers the OpenAI API under ``v1/``, so
the client's documented ``base_url`` option is ``<endpoint>/v1`` and its ``api_key`` the service's token (or the
renter's API key), sent as ``Authorization: Bearer``. This asks for one completion, then streams another and
prints its tokens as they come.

    python examples/openai_client.py --endpoint https://master.example/svc/42/ --token gm_...

``--endpoint`` and ``--token`` default to ``GPUMARKET_SERVICE_URL`` and ``GPUMARKET_SERVICE_TOKEN``; the model to
the first one the server lists (``GET /v1/models``).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator

import openai
from openai.types.chat import ChatCompletionMessageParam

DEFAULT_PROMPT = "Say hello from a rented GPU"


def connect(endpoint: str, token: str, *, timeout: float = 60.0, max_retries: int = 2) -> openai.OpenAI:
    """An OpenAI client for the service at ``endpoint`` (``<master>/svc/<service_id>/``)."""
    return openai.OpenAI(base_url=f"{endpoint.rstrip('/')}/v1", api_key=token, timeout=timeout, max_retries=max_retries)


def chat(endpoint: str, token: str, prompt: str, *, stream: bool = False, model: str | None = None) -> Iterator[str]:
    """The reply to ``prompt``: one piece, or with ``stream`` the pieces as the server streams them. ``model``
    defaults to the first the server lists. Raises the ``openai`` package's errors (``openai.BadRequestError`` …)."""
    client = connect(endpoint, token)
    model = model or client.models.list().data[0].id
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": prompt}]
    if not stream:
        yield client.chat.completions.create(model=model, messages=messages).choices[0].message.content or ""
        return
    with client.chat.completions.create(model=model, messages=messages, stream=True) as chunks:
        for chunk in chunks:
            if chunk.choices and chunk.choices[0].delta.content:
                yield chunk.choices[0].delta.content


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0] if __doc__ else None)
    parser.add_argument("--endpoint", default=os.environ.get("GPUMARKET_SERVICE_URL"),
                        help="the service's endpoint, <master>/svc/<service_id>/ (default: $GPUMARKET_SERVICE_URL)")
    parser.add_argument("--token", default=os.environ.get("GPUMARKET_SERVICE_TOKEN"),
                        help="the service's token or your API key (default: $GPUMARKET_SERVICE_TOKEN)")
    parser.add_argument("--model", help="the model to ask (default: the first the service lists)")
    parser.add_argument("--prompt", default=DEFAULT_PROMPT, help=f"what to ask (default: {DEFAULT_PROMPT!r})")
    args = parser.parse_args(argv)
    if not args.endpoint:
        parser.error("no endpoint: pass --endpoint <master>/svc/<service_id>/ or set GPUMARKET_SERVICE_URL")
    if not args.token:
        parser.error("no token: pass --token or set GPUMARKET_SERVICE_TOKEN (a service token or your API key)")
    try:
        print("completion:", "".join(chat(args.endpoint, args.token, args.prompt, model=args.model)))
        print("streamed:   ", end="", flush=True)
        try:
            for piece in chat(args.endpoint, args.token, args.prompt, stream=True, model=args.model):
                print(piece, end="", flush=True)
        finally:
            print()
    except openai.APIStatusError as exc:
        print(f"openai_client: {args.endpoint}: {exc.message}", file=sys.stderr)
        return 1
    except openai.APIConnectionError as exc:
        print(f"openai_client: cannot reach {args.endpoint} ({exc.__cause__ or exc}): is the service running?", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
