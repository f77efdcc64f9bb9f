"""The top of the stack: what a user calls, built on the actors and the machinery.

- `facade`: `Runtime` and `AgentRef` (`from runtime import Runtime`), which start the
  actors and hand them the shared `Env`;
- `cli`: the `kvactors` command (demo, serve, inspect, import-gguf, bench);
- `demo`: `kvactors demo`;
- `serve`: `kvactors serve`, the OpenAI-compatible HTTP endpoint over the facade.

Nothing in `actors/` or in the machinery (`runtime/*.py`) imports this package;
`tests/test_api.py` checks that from the source.
"""
