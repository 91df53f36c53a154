"""The OpenAI wire formats the edge writes (chunks, results, error objects): pure
functions over domain values, used by the HTTP entrypoints and by batch lines alike."""
