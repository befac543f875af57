"""The OpenAI-compatible server: protocol models, the engine loop bridge, the FastAPI app.

``create_app(engine_loop, served_model_name, context_length)`` builds the app; ``treeverify serve``
(server/cli.py) runs it under uvicorn. Needs the ``fastapi``, ``uvicorn``, ``pydantic`` and
``prometheus-client`` packages; importing this package alone imports none of them.
"""
