"""Triton's CPU interpreter without four pieces of redundant per-op work (CPU suite time).

Under TRITON_INTERPRET=1 every tl operation of every program of a grid runs Python-level frontend code,
and the kernels' CPU tests spend most of their time there. Four parts of that work are done without
effect; this module skips the repetitions and leaves everything else to Triton:

1. Every launch (GridExecutor.__call__) patches the builtins of the triton.language modules its kernel's
   globals name (tl, tl.core) with interpreter versions, and restores them when the launch ends. Triton 3.6
   calls the same _patch_lang again for every call of a nested @jit function (InterpretedFunction.__call__:
   each helper call in each program). Inside a launch that has patched the same modules, that call scans
   triton.language with inspect.getmembers, finds no builtin left (they are the interpreter's wrappers
   already) and re-sets a few attributes to equivalent closures that the launch's restore overwrites.
   It is skipped exactly when every language module of the nested function was patched by the launch in
   progress; every other call goes to Triton's _patch_lang.
2. _get_np_dtype(type) rebuilds a 19-entry dict on each call to look one type up: memoized per type (a
   block type maps as its element type does, the original's own rule; unhashable pointer types go to the
   original each time).
3. InterpreterBuilder.get_block_ty(dtype, shape) builds a new tl.block_type for every block_type.to_ir():
   one shared instance per (dtype, shape). Nothing assigns to a block_type's attributes after __init__,
   and block_type.__eq__ compares values, so sharing instances changes no result.
4. Every tl.tensor's shape is a tl.tuple, and tl.tuple.__init__ builds its tuple_type (a constexpr_type per
   dimension and the type's name string) at once, although that type is rarely read: built when first read
   instead, from the same values (a tuple's values change only in tuple._setitem, which reads and then sets the
   type itself; element types are set in their __init__ only). A type passed to __init__ is kept as before. The
   one difference: a tuple holding a value without a type (which the original rejects when building it) would
   only fail where its type is read; on every path where Triton's interpreter does not raise, results are equal.

Kernel outputs are bitwise those of the unmodified interpreter (checked on the forward and backward of a causal
GQA call with a padded head dim, the same with attn_mask, window, softcap and ALiBi, with dropout, with TMA tiles
and atomic dQ, on a varlen call with window and softcap, and on a KV-cache decode; tests/test_interpreter_shortcuts.py
checks one such call on every CPU run). Installed by tests/conftest.py on CPU runs, for the Triton version whose
interpreter this was read against (3.6; CI pins triton==3.6.0); with any other version the interpreter runs
unchanged.
"""

from __future__ import annotations

_patched: set[int] | None = None  # ids of the language modules the launch in progress patched; None outside


def install() -> bool:
    import triton
    import triton.language as tl
    from triton.runtime import interpreter

    if not triton.__version__.startswith("3.6.") or getattr(interpreter, "_fa_backend_shortcuts", False):
        return False
    orig_patch_lang = interpreter._patch_lang
    orig_grid_call = interpreter.GridExecutor.__call__
    orig_np_dtype = interpreter._get_np_dtype
    orig_block_ty = interpreter.InterpreterBuilder.get_block_ty

    lang_ids = {id(tl), id(tl.core)}

    def patch_lang(fn):
        global _patched
        langs = {id(v) for v in fn.__globals__.values()} & lang_ids  # the modules Triton's _patch_lang patches
        # a helper that sees no language module goes to Triton's _patch_lang too (which asserts there, as before)
        if langs and _patched and langs <= _patched:
            return interpreter._LangPatchScope()  # records nothing: nothing to restore
        scope = orig_patch_lang(fn)
        if _patched is not None:
            _patched |= langs
        return scope

    def grid_call(self, *args, **kwargs):
        global _patched
        saved, _patched = _patched, set()
        try:
            return orig_grid_call(self, *args, **kwargs)
        finally:
            _patched = saved

    np_dtypes: dict = {}

    def get_np_dtype(tt_dtype):
        key = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        try:
            return np_dtypes[key]
        except KeyError:
            np_dtypes[key] = result = orig_np_dtype(key)
            return result
        except TypeError:  # unhashable (pointer types)
            return orig_np_dtype(key)

    block_types: dict = {}

    def get_block_ty(self, dtype, shape):
        key = (dtype, tuple(shape))
        try:
            return block_types[key]
        except KeyError:
            block_types[key] = result = orig_block_ty(self, dtype, shape)
            return result
        except TypeError:  # unhashable (pointer types)
            return orig_block_ty(self, dtype, shape)

    def tuple_init(self, args, type=None):
        self.values = [i for i in args]
        if isinstance(type, tl.core.tuple_type):
            self.type = type
        elif type is not None:  # as the original: a list / tuple of types
            self.type = tl.core.tuple_type(type)

    class LazyTupleType:
        """tl.tuple.type, from the values when first read; a non-data descriptor, so the instance's own attribute
        (set by __init__ when a type is given, by _setitem, or by the first read) takes precedence."""

        def __get__(self, obj, objtype=None):
            if obj is None:
                return self
            try:
                obj.type = result = tl.core._type_for_tuple_values(obj.values)
            except AttributeError as e:  # not as AttributeError: tuple.__getattr__ would look "type" up again
                raise TypeError(f"tl.tuple of a value without a type: {e}") from e
            return result

    interpreter._patch_lang = patch_lang
    interpreter.GridExecutor.__call__ = grid_call
    interpreter._get_np_dtype = get_np_dtype
    interpreter.InterpreterBuilder.get_block_ty = get_block_ty
    tl.core.tuple.__init__ = tuple_init
    tl.core.tuple.type = LazyTupleType()
    interpreter._fa_backend_shortcuts = True
    return True
