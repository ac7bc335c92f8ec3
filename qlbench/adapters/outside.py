"""Methods from outside qlbench, by name: `package.module:NAME`, or an installed package's entry point in the group
`qlbench.methods` (docs/extending.md).

The object found must be a qlbench `Method` instance (a `MemberMethod` for a method written for one plain model, or
an `AdapterMethod` with stacked layers). It is registered under its own `name`, the name its records carry; a name
that clashes with a registered method of another object is refused.
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points

from qlbench.adapters.base import Method

GROUP = "qlbench.methods"


def is_spec(name: str) -> bool:
    """Whether `name` reads as package.module:NAME (a module path, a colon, an attribute)."""
    module, colon, attr = name.partition(":")
    return bool(colon) and bool(module) and bool(attr) and all(p.isidentifier() for p in module.split("."))


def load(spec: str) -> Method:
    """The Method at package.module:NAME; ValueError in one line for a module that does not import, a missing
    attribute, or an object that is not a Method."""
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # noqa: BLE001 - any failure to import is the user's module's, reported in one line
        raise ValueError(
            f"method {spec!r}: module {module_name!r} does not import ({type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else ''})"
        ) from None
    if not hasattr(module, attr):
        raise ValueError(f"method {spec!r}: module {module_name!r} has no attribute {attr!r}")
    return _checked(getattr(module, attr), spec)


def _checked(obj, where: str) -> Method:
    if not isinstance(obj, Method):
        what = f"the class {obj.__name__}" if isinstance(obj, type) else f"a {type(obj).__name__}"
        raise ValueError(
            f"method {where!r} is {what}, not a qlbench Method instance (qlbench.adapters.Method; docs/extending.md)"
        )
    if not isinstance(getattr(obj, "name", None), str) or not obj.name:
        raise ValueError(f"method {where!r} has no name (a non-empty string attribute `name`)")
    return obj


def entry_point_names() -> list[str]:
    """The method names installed packages declare in the `qlbench.methods` entry-point group."""
    return sorted(ep.name for ep in entry_points(group=GROUP))


def from_entry_point(name: str) -> Method | None:
    """The Method an installed package declares under `name` in the group, or None when none does."""
    found = [ep for ep in entry_points(group=GROUP) if ep.name == name]
    if not found:
        return None
    try:
        obj = found[0].load()
    except Exception as err:  # noqa: BLE001 - as in load()
        raise ValueError(
            f"method {name!r}: entry point {found[0].value!r} does not load ({type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else ''})"
        ) from None
    method = _checked(obj, f"{found[0].value} (entry point {name})")
    if method.name != name:
        raise ValueError(f"entry point {name!r} names a method called {method.name!r}; they must agree")
    return method


def provenance(method: Method) -> dict:
    """Where a method from outside qlbench came from, for its records (run_info.settings.origin): its module, the
    distribution (package) that provides the module and that package's installed version (None where the module is
    not from an installed package, e.g. found on the Python path); {} for qlbench's own methods and peft's tuners
    (qlbench's version and peft's are recorded with every record)."""
    module = type(method).__module__
    top = module.split(".")[0]
    if top in ("qlbench", "peft"):
        return {}
    import importlib.metadata as md

    names = md.packages_distributions().get(top, [])
    package = names[0] if names else None
    version = None
    if package:
        try:
            version = md.version(package)
        except md.PackageNotFoundError:
            pass
    return {"origin": {"module": module, "package": package, "version": version}}
