"""The graph compiler: the SDK's `CustomLossGraph` (torch.fx nodes as plain data: the
`placeholder / call_function / call_method / getattr / output` ops, targets such as
`torch.exp` or `operator.mul`, encoded arguments) checked node by node and turned into a
bounded Program.

Every target is looked up in the op table (ops.py) only; a name that is not a key of its
tables is refused with an InputError naming the node. Graphs are bounded in nodes, inputs,
depth and literal entries (limits.py), and every node is typed by the cost model (cost.py)
as it is read.
"""

from __future__ import annotations

from collections.abc import Mapping

from jcp.custom_loss.args import Dict, Tuple, decode, entries
from jcp.custom_loss.cost import ATTRIBUTE_KINDS, TENSOR, Kind, node_kind
from jcp.custom_loss.limits import MAX_DEPTH, MAX_LITERALS, MAX_NODES
from jcp.custom_loss.ops import ATTRIBUTES, FUNCTIONS, METHODS
from jcp.custom_loss.program import Program
from jcp.errors import InputError


def compile_graph(graph, input_names: list[str]) -> Program:
    """The graph checked and turned into fn(logprobs, *inputs); InputError on anything not
    allowed, naming the node."""
    if not isinstance(graph, Mapping) or not isinstance(graph.get("nodes"), list):
        raise InputError("custom loss graph must be {format: 1, nodes: [...]}")
    if graph.get("format", 1) != 1:
        raise InputError(f"custom loss graph format {graph.get('format')!r} is not 1")
    nodes = graph["nodes"]
    if not nodes:
        raise InputError("custom loss graph has no nodes")
    if len(nodes) > MAX_NODES:
        raise InputError(f"custom loss graph has {len(nodes)} nodes; at most {MAX_NODES}")
    reader = _Reader(input_names)
    for j, node in enumerate(nodes):
        reader.add(j, node)
    return reader.program()


class _Reader:
    """The nodes read so far: each one's depth and cost-model kind, the program's steps
    (name, callable, args, kwargs, where) in order, its placeholders and output."""

    def __init__(self, input_names: list[str]):
        self.input_names = input_names
        self.depth: dict[str, int] = {}
        self.kinds: dict[str, Kind] = {}  # the cost model's view of each node's value
        self.literals = 0
        self.steps = []
        self.placeholders = []
        self.output = None

    def add(self, j: int, node) -> None:
        """Read nodes[j]: InputError naming it unless it is allowed where it stands."""
        if not isinstance(node, Mapping):
            raise InputError(f"custom loss graph: nodes[{j}] is not an object")
        op, name, target = node.get("op"), node.get("name"), node.get("target")
        where = f"custom loss graph: node {j} ({name!r}"
        if not isinstance(name, str) or not name or len(name) > 128 or name in self.depth:
            raise InputError(f"{where}): name must be a unique string")
        if not isinstance(target, str) or len(target) > 256:
            raise InputError(f"{where}): target must be a string")
        where = f"{where}, {op} {target!r})"
        if self.output is not None:
            raise InputError(f"{where}: follows the output node")
        args, kwargs, d = self._arguments(node, where)
        if op == "placeholder":
            self._placeholder(name, target, where)
        elif op == "call_function":
            self._call_function(name, target, args, kwargs, where)
        elif op == "call_method":
            fn = METHODS.get(target)
            if fn is None:
                raise InputError(
                    f"{where}: tensor method {target!r} is not allowed in a custom loss"
                )
            if not args:
                raise InputError(f"{where}: a method call needs its tensor")
            self.steps.append((name, fn, args, kwargs, where))
        elif op == "output":
            if len(args) != 1 or kwargs:
                raise InputError(f"{where}: the output node has one argument")
            self.output = args[0]
        else:
            raise InputError(
                f"{where}: op {op!r} is not allowed in a custom loss (only "
                "placeholder, call_function, call_method, output)"
            )
        if op != "output" and name not in self.kinds:
            self.kinds[name] = node_kind(op, target, args, kwargs, self.kinds, where)
        self.depth[name] = d

    def _arguments(self, node, where: str) -> tuple[list, dict, int]:
        """(decoded args, decoded kwargs, the node's depth), within the literal and depth
        bounds."""
        args, kwargs = node.get("args", []), node.get("kwargs", {})
        if not isinstance(args, list) or not isinstance(kwargs, Mapping):
            raise InputError(f"{where}: args must be a list and kwargs an object")
        refs: list[str] = []
        args = [decode(a, self.depth, refs, where) for a in args]
        kwargs = {str(k): decode(v, self.depth, refs, where) for k, v in kwargs.items()}
        self.literals += entries(args) + entries(list(kwargs.values()))
        if self.literals > MAX_LITERALS:
            raise InputError(
                f"{where}: the graph's arguments hold over {MAX_LITERALS} literal entries"
            )
        d = 1 + max((self.depth[r] for r in refs), default=0)
        if d > MAX_DEPTH:
            raise InputError(f"{where}: the graph is deeper than {MAX_DEPTH} operations")
        return args, kwargs, d

    def _placeholder(self, name: str, target: str, where: str) -> None:
        names, placeholders = self.input_names, self.placeholders
        if self.steps or len(placeholders) >= len(names) or target != names[len(placeholders)]:
            raise InputError(f"{where}: placeholders must be the declared inputs {names} in order")
        placeholders.append(name)

    def _call_function(self, name: str, target: str, args: list, kwargs: dict, where: str):
        fn = FUNCTIONS.get(target)
        if target == "getattr":
            if (
                len(args) != 2
                or kwargs
                or not isinstance(args[1], str)
                or args[1] not in ATTRIBUTES
            ):
                raise InputError(
                    f"{where}: reads attribute "
                    f"{args[1] if len(args) > 1 else None!r}; allowed: "
                    f"{sorted(ATTRIBUTES)}"
                )
            self.kinds[name] = ATTRIBUTE_KINDS.get(args[1], TENSOR)
            fn, args = ATTRIBUTES[args[1]], args[:1]
        if fn is None:
            raise InputError(f"{where}: {target!r} is not an allowed function of a custom loss")
        self.steps.append((name, fn, args, kwargs, where))

    def program(self) -> Program:
        """The Program of the nodes read; InputError unless they read the declared inputs
        and return (loss, metrics dict)."""
        if len(self.placeholders) != len(self.input_names):
            raise InputError(
                f"custom loss graph reads {len(self.placeholders)} inputs, declared "
                f"{len(self.input_names)} ({self.input_names})"
            )
        output = self.output
        if output is None:
            raise InputError("custom loss graph has no output node")
        if not (
            isinstance(output, Tuple)
            and len(output.items) == 2
            and isinstance(output.items[1], Dict)
        ):
            raise InputError("custom loss graph must return (loss, metrics dict)")
        return Program(tuple(self.placeholders), tuple(self.steps), output)
