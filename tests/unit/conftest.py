"""The unit tier: no Ray, no spawned processes, no servers; the whole tier runs in seconds.
Its fixtures build, in this process, what a composed config needs (a tiny checkpoint, a tiny
chat checkpoint); the process fixtures are not offered here."""

from tests.support.fixtures import chat_model_path, tiny_path  # noqa: F401
