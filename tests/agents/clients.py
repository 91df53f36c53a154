"""Python client libraries against the edge, as their users write them: LlamaIndex,
litellm, instructor and pydantic-ai.

Run by ``test_python_clients.py`` with the interpreter of ``var/clients`` (``make
agents`` installs the libraries there at pinned versions: their dependency trees pin
``openai`` differently from each other and from ``.venv``). Usage::

    python clients.py ORIGIN MODEL CHECK

prints one JSON object: what the check got back. A check that raises exits non-zero with
the traceback, which the test shows.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, Field

API_KEY = "iop-clients-test"


class City(BaseModel):
    """A structured answer with constraints the mock's tool arguments must satisfy."""

    name: str = Field(min_length=1)
    population: int = Field(gt=0)
    area_km2: float = Field(ge=0)
    kind: str = Field(pattern="^(city|town)$")


def litellm_completion(origin: str, model: str) -> dict[str, Any]:
    import litellm

    answer = litellm.completion(
        model=f"openai/{model}",
        api_base=f"{origin}/v1",
        api_key=API_KEY,
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=32000,
    )
    chunks = litellm.completion(
        model=f"openai/{model}",
        api_base=f"{origin}/v1",
        api_key=API_KEY,
        messages=[{"role": "user", "content": "Say hello."}],
        stream=True,
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return {
        "text": answer.choices[0].message.content,
        "finish_reason": answer.choices[0].finish_reason,
        "streamed": streamed,
    }


def instructor_tools(origin: str, model: str) -> dict[str, Any]:
    import instructor
    from openai import OpenAI

    client = instructor.from_openai(
        OpenAI(base_url=f"{origin}/v1", api_key=API_KEY), mode=instructor.Mode.TOOLS
    )
    city = client.chat.completions.create(
        model=model,
        response_model=City,
        max_retries=0,
        messages=[{"role": "user", "content": "Describe a city."}],
    )
    return {"city": city.model_dump()}


def pydantic_ai_agents(origin: str, model: str) -> dict[str, Any]:
    from pydantic_ai import Agent
    from pydantic_ai.models.anthropic import AnthropicModel
    from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
    from pydantic_ai.providers.anthropic import AnthropicProvider
    from pydantic_ai.providers.openai import OpenAIProvider

    openai_provider = OpenAIProvider(base_url=f"{origin}/v1", api_key=API_KEY)
    models = {
        "chat": OpenAIChatModel(model, provider=openai_provider),
        "responses": OpenAIResponsesModel(model, provider=openai_provider),
        "messages": AnthropicModel(
            model, provider=AnthropicProvider(base_url=origin, api_key=API_KEY)
        ),
    }
    got: dict[str, Any] = {}
    for api, chosen in models.items():
        text = Agent(chosen).run_sync("Say hello.")
        city = Agent(chosen, output_type=City).run_sync("Describe a city.")
        got[api] = {"text": text.output, "city": city.output.model_dump()}
    return got


def llamaindex_chat(origin: str, model: str) -> dict[str, Any]:
    from llama_index.core.llms import ChatMessage
    from llama_index.llms.openai_like import OpenAILike

    llm = OpenAILike(
        model=model,
        api_base=f"{origin}/v1",
        api_key=API_KEY,
        is_chat_model=True,
        context_window=8192,
    )
    answer = llm.chat([ChatMessage(role="user", content="Say hello.")])
    streamed = "".join(
        part.delta or "" for part in llm.stream_chat([ChatMessage(role="user", content="Hi.")])
    )

    async def concurrently() -> list[str]:
        replies = await asyncio.gather(*(llm.acomplete(f"Count to {n}.") for n in range(3)))
        return [reply.text for reply in replies]

    return {
        "text": answer.message.content,
        "streamed": streamed,
        "async": asyncio.run(concurrently()),
    }


CHECKS: dict[str, Callable[[str, str], dict[str, Any]]] = {
    "litellm": litellm_completion,
    "instructor": instructor_tools,
    "pydantic-ai": pydantic_ai_agents,
    "llamaindex": llamaindex_chat,
}

if __name__ == "__main__":
    origin, model, check = sys.argv[1:4]
    print(json.dumps(CHECKS[check](origin, model)))
