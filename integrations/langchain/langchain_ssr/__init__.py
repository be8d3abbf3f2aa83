"""LangChain integration for SSR: ``ChatSSR``, a chat model that thinks and answers with self-speculation."""

from langchain_ssr.chat_models import ChatSSR

__all__ = ["ChatSSR"]
