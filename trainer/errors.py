"""One-line reports of exceptions (`first_line`): what a run, a tool or a restore prints when
something it tried failed and it goes on or stops with one line instead of a traceback."""


def first_line(e: BaseException, *, with_type: bool = True) -> str:
  """`ExceptionType: first non-empty line of its message` (at most 300 characters; without the
  type if `with_type` is False)."""
  lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
  text = lines[0][:300] if lines else ""
  if not with_type:
    return text or type(e).__name__
  return f"{type(e).__name__}: {text}"
