"""OpenAI-compatible serving: :func:`pyspec.serve.app.create_app` and ``pyspec serve``."""
