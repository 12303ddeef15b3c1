"""One-line reports of exceptions (`first_line`): what a run, a tool or a restore prints when
something it tried failed and it goes on or stops with one line instead of a traceback."""


TENSORSTORE_SPEC = "See full TensorStore details:"  # followed by a store's whole spec


def first_line(e: BaseException, *, with_type: bool = True) -> str:
  """`ExceptionType: first non-empty line of its message` (at most 300 characters; without the
  type if `with_type` is False). Where Orbax wraps a TensorStore error (its message ends in the
  store's whole spec), the cause is said instead."""
  text = str(e)
  cause = e.__cause__ or e.__context__
  if TENSORSTORE_SPEC in text:  # "error while reading array index: ...": the cause says what
    return first_line(cause, with_type=with_type) if cause else \
        first_line(RuntimeError(text.split(TENSORSTORE_SPEC)[0]), with_type=False)
  lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
  text = lines[0][:300] if lines else ""
  if not with_type:
    return text or type(e).__name__
  return f"{type(e).__name__}: {text}"
