"""Every source file under pagedserve/ stays at most 500 lines and every function at most 60, except Triton
kernel bodies (`@triton.jit`), which a split would only scatter (read from the source, not run)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 60


def _is_kernel_body(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """Decorated with `triton.jit` (bare or called, e.g. `@triton.jit(do_not_specialize=...)`)."""
    for decorator in node.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        if ast.unparse(target) == "triton.jit":
            return True
    return False


def long_functions(source: str) -> list[tuple[str, int]]:
    """(qualified name, lines from `def` to its last line) of each function over the limit, kernels aside."""
    found = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = f"{prefix}{getattr(child, 'name', '')}"
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = child.end_lineno - child.lineno + 1
                if length > MAX_FUNCTION_LINES and not _is_kernel_body(child):
                    found.append((name, length))
                visit(child, f"{name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return found


def _sources() -> list[Path]:
    files = sorted((ROOT / "pagedserve").rglob("*.py"))
    assert len(files) > 100  # the package is where this test thinks it is
    return files


def test_no_source_file_is_over_500_lines():
    over = {str(f.relative_to(ROOT)): n for f in _sources() if (n := len(f.read_text().splitlines())) > MAX_FILE_LINES}
    assert over == {}


def test_no_function_is_over_60_lines_outside_triton_kernel_bodies():
    over = {f"{f.relative_to(ROOT)}:{name}": n for f in _sources() for name, n in long_functions(f.read_text())}
    assert over == {}


def test_a_long_method_is_found_and_a_long_kernel_body_is_not():
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES - 1))
    source = (f"class Runner:\n  def step(self):\n{body}    return x0\n"
              f"@triton.jit\ndef kernel():\n{body}    return x0\n"
              f"@triton.jit(do_not_specialize=['n'])\ndef kernel2(n):\n{body}    return x0\n"
              f"def short():\n{body}")
    assert long_functions(source) == [("Runner.step", MAX_FUNCTION_LINES + 1)]
