"""A shared library's ELF image read from its bytes: whether it is whole, and one exported string.

``dlopen`` runs a library's constructors before any of our code can look at it, and maps segments that
a truncated file no longer holds (a ``SIGBUS`` when the loader touches them). So the build cache reads
what a library is from the file's bytes first: the header, every loaded segment and section inside the
file, and the exported ``const char[]`` that names the build (``tapegrad.native.build.IDENTITY``).
Nothing here maps or runs the file.
"""
import struct

ET_DYN, PT_LOAD, SHT_NOBITS, SHT_DYNSYM = 3, 1, 8, 11


class NotLibrary(ValueError):
    """The bytes are not a whole ELF shared library; the message says what is wrong."""


class Image:
    """The ELF header, program headers and section headers of ``data``, each checked to lie in the file."""

    def __init__(self, data: bytes):
        self.data = data
        n = len(data)
        if n < 16 or data[:4] != b"\x7fELF":
            raise NotLibrary(f"not an ELF file (it starts {bytes(data[:8])!r}, {n} bytes)")
        if data[4] not in (1, 2) or data[5] not in (1, 2):
            raise NotLibrary(f"an ELF header of unknown class {data[4]} or byte order {data[5]}")
        self.wide = data[4] == 2
        self.end = "<" if data[5] == 1 else ">"
        head = self.end + ("HHIQQQIHHHHHH" if self.wide else "HHIIIIIHHHHHH")
        if n < 16 + struct.calcsize(head):
            raise NotLibrary(f"truncated: {n} bytes hold no whole ELF header")
        (etype, _, _, _, phoff, shoff, _, _, phsize, phnum, shsize, shnum, self.shstrndx) = \
            struct.unpack_from(head, data, 16)
        if etype != ET_DYN:
            raise NotLibrary(f"an ELF file of type {etype}, not a shared library ({ET_DYN})")
        ph = self.end + ("IIQQQQQQ" if self.wide else "IIIIIIII")
        sh = self.end + ("IIQQQQIIQQ" if self.wide else "IIIIIIIIII")
        if phnum and phsize < struct.calcsize(ph) or shnum and shsize < struct.calcsize(sh):
            raise NotLibrary("ELF header entries smaller than the format's")
        self._inside(phoff, phnum * phsize, "the program header table")
        self._inside(shoff, shnum * shsize, "the section header table")
        for k in range(phnum):
            f = struct.unpack_from(ph, data, phoff + k * phsize)
            ptype, off, filesz = (f[0], f[2], f[5]) if self.wide else (f[0], f[1], f[4])
            if ptype == PT_LOAD:
                self._inside(off, filesz, f"loaded segment {k}")
        self.sections = []
        for k in range(shnum):
            name, stype, _, addr, off, size, link, _, _, entsize = struct.unpack_from(sh, data, shoff + k * shsize)
            if stype != SHT_NOBITS:
                self._inside(off, size, f"section {k}")
            self.sections.append((stype, addr, off, size, link, entsize))

    def _inside(self, off, size, what):
        if off + size > len(self.data):
            raise NotLibrary(f"truncated: {what} ends at byte {off + size}, the file has {len(self.data)}")

    def string(self, name: str):
        """The NUL-terminated string of the exported data symbol ``name`` (``None`` if it exports none)."""
        sym = self.end + ("IBBHQQ" if self.wide else "IIIBBH")
        want = name.encode()
        for stype, _, off, size, link, entsize in self.sections:
            if stype != SHT_DYNSYM or not entsize or link >= len(self.sections):
                continue
            strs = self.sections[link]
            for k in range(size // entsize):
                f = struct.unpack_from(sym, self.data, off + k * entsize)
                at, value, shndx = (f[0], f[4], f[3]) if self.wide else (f[0], f[1], f[5])
                end = self.data.find(b"\0", strs[2] + at, strs[2] + strs[3])
                if end < 0 or self.data[strs[2] + at:end] != want or not 0 < shndx < len(self.sections):
                    continue
                stype2, addr, soff, ssize, _, _ = self.sections[shndx]
                lo = soff + value - addr
                stop = self.data.find(b"\0", lo, soff + ssize)
                if stype2 == SHT_NOBITS or not soff <= lo or stop < 0:
                    raise NotLibrary(f"the symbol {name} lies outside its section")
                return self.data[lo:stop].decode("utf-8", "replace")
        return None
