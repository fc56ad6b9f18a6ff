"""The reverse sweep of a repeated episode, recorded once and replayed without its bookkeeping.

A training loop records the same graph every step: the same ops on the same node ids and shapes. Its
reverse sweep then makes the same decisions every step too: which nodes a gradient reaches, which rule
runs, whether a contribution is adopted, copied or added, which scratch buffer the arena hands out.
``Tape.backward`` records those decisions once (a ``Schedule``) and, while later episodes have the
same structure, replays them: each step calls the rule (an ``into`` rule's ufuncs directly on the
recorded scratch) and applies the recorded accumulation. The calls, their arguments and their order are
those of the sweep, so the gradients are the same bits; only the per-node bookkeeping goes.
"""
import operator

import numpy as np

# What the sweep reads of a node: op, input ids, static operand, shape, third input.
_KEY = operator.itemgetter(0, 1, 2, 3, 8, 10)

# What Tape._accumulate did with a contribution (bit 8: it first summed the contribution over the
# broadcast axes into a scratch buffer). A replay does two things the sweep does not: DIRECT runs an
# ``into`` rule straight on the input's gradient buffer where the sweep computed into scratch and copied
# (COPY), and a copied view of the node's own gradient is adopted where nothing adds to it afterwards.
INTO, ADOPT, NEW, COPY, ADD, DIRECT = range(6)
SUMMED = 8


class Schedule:
    """One recorded sweep: valid while ``fits`` (same structure, same arena position, same gradient
    buffers present)."""
    __slots__ = ("pos", "keys", "empty", "steps", "end")

    def __init__(self, tape, top, pos):
        self.pos = pos
        self.keys = list(map(_KEY, tape._nodes[:top + 1]))
        self.empty = []   # (target, whether its gradient buffer was None before the sweep)
        self.steps = []
        self.end = None

    def add(self, tape, k, j, rule, f, c, pos, code, buf):
        """Write down one step of the sweep (what ``Tape._record`` saw it do), with what it reads of
        node k that is fixed while the schedule fits: its inputs and the extra argument its rules take
        (-1: none, -2: the buffers its forward kept, else the data input's id). Not its static operand:
        0.0 == -0.0 fits, yet scales by another sign."""
        if code == COPY and f is not None:
            code, c = DIRECT, None
        op, a, b, *_, x = tape._nodes[k]
        x = -2 if op.keep is not None else x
        self.steps.append((k, j, a, b, x, rule, f, c, pos, code, buf))

    def close(self, end):
        """The sweep is over. A contribution copied into a new buffer (NEW) came from an op whose rules
        return g or a view of it; where nothing adds to that input later, the replay adopts the view
        instead: the node's gradient is final once its rules ran, so both would hold the same values."""
        self.end = end
        last = {step[1]: n for n, step in enumerate(self.steps)}
        for n, step in enumerate(self.steps):
            if step[9] == NEW and last[step[1]] == n:
                self.steps[n] = step[:9] + (ADOPT, None)

    def fits(self, tape, top, pos):
        """Whether replaying gives what the sweep would: the nodes up to ``top`` equal the recorded ones
        in everything the sweep reads (all but the epoch and the source line). ``req`` and ``lazy`` are
        not compared: a leaf's follow from its op (and ``s`` for a lazy constant), an op node's from its
        inputs'."""
        if pos != self.pos or list(map(_KEY, tape._nodes[:top + 1])) != self.keys:   # (and so the same top)
            return False
        grads = tape._grad
        return all((grads[j] is None) is none for j, none in self.empty)

    def replay(self, tape):
        if tape._fast is not None:   # the same loop in C (tapegrad/_ctape.c; tests/test_ctape.py compares them)
            return tape._fast.replay(self.steps, self.end, tape)  # pragma: no mutate
        nodes, vals, grads, gpass, ws = tape._nodes, tape._val, tape._grad, tape._gpass, tape._grads
        kept = tape._arena_grads
        p = tape._pass
        for k, j, a, b, x, rule, f, t, pos, code, buf in self.steps:
            g, out, va, vb, s = grads[k], vals[k], vals[a], None if b < 0 else vals[b], nodes[k][3]
            if f is not None:
                if code == DIRECT:
                    f(g, out, va, vb, s, grads[j])
                    gpass[j] = p
                    continue
                f(g, out, va, vb, s, t)
                c = t
            else:
                ws.rewind(pos)
                if x == -1:
                    c = rule(g, out, va, vb, s, ws)
                else:
                    c = rule(g, out, va, vb, s, ws, tape._kept[k] if x == -2 else vals[x])
            if code & SUMMED:
                np.add.reduce(c, axis=buf[1], out=buf[0])
                c, buf, code = buf[2], None, code & 7
            if code == ADOPT:
                grads[j] = c
                kept.append(j)
            elif code == ADD:
                g = grads[j]
                np.add(g, c, out=g)
            elif code == NEW:
                np.copyto(buf, c)
                grads[j] = buf
                kept.append(j)
            elif code == COPY:
                np.copyto(grads[j], c)
            else:   # INTO: summed straight into the existing buffer
                np.add.reduce(c, axis=buf[0], out=grads[j].reshape(buf[1]))
            gpass[j] = p
        ws.rewind(self.end)
