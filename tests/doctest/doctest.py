#!/usr/bin/env python3
"""idem's doc tests: every ```cpp block of README.md and docs/*.md, compiled (and, when it says
so, run and checked), the rustdoc way. See docs/testing.md#doc-tests for the markers.

  doctest.py generate --source-dir DIR --out DIR
      Extracts the blocks and writes one C++ translation unit per doc file (each block in a
      namespace of its own, inside its wrapper), one per compile_fail block, doctests.cmake (the
      sources, for tests/doctest/CMakeLists.txt) and manifest.json (what the test checks).
  doctest.py test --build-dir DIR --manifest FILE --binary FILE [--config CFG]
      What ctest runs: builds the doc-test binary (every compiled block) and runs it, builds
      each compile_fail block and checks that it fails with its message, and prints the counts
      and the times.
  doctest.py list [--source-dir DIR]
      Prints every C++ block with its marker.

A marker is an HTML comment on the line right before the fence (invisible on GitHub):

  <!-- doctest: wrapper=NAME run -->
  <!-- doctest: compile_fail="REGEX" wrapper=NAME -->
  <!-- doctest: program -->                  (a complete program, main() included: built and run)
  <!-- doctest: output vary="REGEX" -->      (on a text block after a `run` block: what it
                                              prints to std::cout; what REGEX matches may vary)

Without a marker a block is compiled as it is, at namespace scope. A block that cannot be
compiled is a failure: nothing is skipped. A wrapper (tests/doctest/wrappers/NAME.hpp) is C++
with one line `// @block` where the block goes, and may take shared types from another with
`// @use OTHER`; a block marked `run` is run through the wrapper's doctest_run().
"""

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import time

FENCE = re.compile(r"^( *)(`{3,}|~{3,})[ \t]*([^ \t`]*)[^`]*$")
MARKER = re.compile(r"^\s*<!--\s*doctest:(.*?)-->\s*$")
ANY_MARKER = re.compile(r"^\s*<!--.*doctest")  # a comment line naming doctest: must be a marker
INCLUDE = re.compile(r"^\s*#\s*include\b")
BLOCK_LINE = re.compile(r"^\s*// @block\s*$")
CPP_LANGS = {"cpp", "c++", "cxx"}
KEYS = {"wrapper", "run", "compile_fail", "output", "vary", "program"}
OUTPUT_DELIMITER = "idem_doc"  # a raw string's delimiter: at most 16 characters
WRAPPERS_DIR = os.path.join("tests", "doctest", "wrappers")


class DocError(Exception):
    pass


def doc_files(source_dir):
    files = ["README.md"]
    docs = os.path.join(source_dir, "docs")
    files += sorted("docs/" + name for name in os.listdir(docs) if name.endswith(".md"))
    return files


def parse_marker(text, where):
    try:
        words = shlex.split(text)
    except ValueError as e:
        raise DocError(f"{where}: unreadable doctest marker ({e})")
    marker = {}
    for word in words:
        key, _, value = word.partition("=")
        if key not in KEYS:
            raise DocError(f"{where}: unknown doctest marker key '{key}' (known: "
                           f"{', '.join(sorted(KEYS))})")
        if key in ("wrapper", "compile_fail", "vary") and not value:
            raise DocError(f"{where}: doctest marker key '{key}' needs a value ({key}=...)")
        if key in ("run", "output", "program") and value:
            raise DocError(f"{where}: doctest marker key '{key}' takes no value")
        marker[key] = value if value else True
    return marker


def parse_doc(source_dir, rel):
    """The fenced blocks of one Markdown file, with their markers."""
    with open(os.path.join(source_dir, rel), encoding="utf-8") as f:
        lines = f.read().split("\n")
    blocks = []
    i = 0
    used_markers = set()
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = len(m.group(1)), m.group(2), m.group(3).lower()
        start = i
        body = []
        i += 1
        while i < len(lines):
            closing = re.match(r"^ *" + re.escape(fence[0]) + "{" + str(len(fence)) + r",}\s*$",
                               lines[i])
            if closing:
                break
            line = lines[i]
            strip = min(indent, len(line) - len(line.lstrip(" ")))
            body.append(line[strip:])
            i += 1
        else:
            raise DocError(f"{rel}:{start + 1}: a fence that is never closed")
        marker = None
        if start > 0:
            mm = MARKER.match(lines[start - 1])
            if mm:
                marker = parse_marker(mm.group(1), f"{rel}:{start}")
                used_markers.add(start - 1)
        blocks.append({"doc": rel, "line": start + 1, "lang": lang, "body": body,
                       "marker": marker or {}})
        i += 1
    for n, line in enumerate(lines):
        if ANY_MARKER.search(line) and n not in used_markers:
            raise DocError(f"{rel}:{n + 1}: a doctest marker must be the line right before a "
                           "fence (and read '<!-- doctest: ... -->')")
    return blocks


USE_LINE = re.compile(r"^\s*// @use ([A-Za-z0-9_]+)\s*$")


def expand_wrapper(source_dir, name, where, seen=()):
    """A wrapper's lines as (text, file, line) triples, its `// @use NAME` lines replaced by the
    lines of wrappers/NAME.hpp (shared user types)."""
    path = os.path.join(WRAPPERS_DIR, name + ".hpp")
    full = os.path.join(source_dir, path)
    if not os.path.isfile(full):
        raise DocError(f"{where}: no wrapper '{name}' ({path} does not exist)")
    if name in seen:
        raise DocError(f"{path}: '// @use {name}' uses itself")
    with open(full, encoding="utf-8") as f:
        lines = f.read().rstrip("\n").split("\n")
    out = []
    for n, line in enumerate(lines):
        used = USE_LINE.match(line)
        if used:
            out += expand_wrapper(source_dir, used.group(1), f"{path}:{n + 1}", seen + (name,))
        else:
            out.append((line, path, n + 1))
    return out


def read_wrapper(source_dir, name, where):
    lines = expand_wrapper(source_dir, name, where)
    at = [n for n, (line, _, _) in enumerate(lines) if BLOCK_LINE.match(line)]
    if len(at) != 1:
        raise DocError(f"{WRAPPERS_DIR}/{name}.hpp: a wrapper has exactly one '// @block' line "
                       f"(found {len(at)}, with what it uses)")
    return {"name": name, "lines": lines, "at": at[0]}


def slug_of(rel):
    base = rel[:-3] if rel.endswith(".md") else rel
    return re.sub(r"[^A-Za-z0-9]", "_", base)


def collect(source_dir):
    """Every C++ block of the docs, checked for marker errors; and the output checks."""
    cases = []
    errors = []
    others = {}
    for rel in doc_files(source_dir):
        try:
            blocks = parse_doc(source_dir, rel)
        except DocError as e:
            errors.append(str(e))
            continue
        last_cpp = None
        for block in blocks:
            where = f"{rel}:{block['line']}"
            marker = block["marker"]
            if block["lang"] in CPP_LANGS:
                if "output" in marker or "vary" in marker:
                    errors.append(f"{where}: 'output' and 'vary' mark the text block a `run` "
                                  "block prints, not the C++ block itself")
                if "compile_fail" in marker and "run" in marker:
                    errors.append(f"{where}: a compile_fail block cannot also be run")
                if "program" in marker and set(marker) - {"program"}:
                    errors.append(f"{where}: a program is compiled and run as it is: no other "
                                  "marker key goes with `program`")
                if "run" in marker and "wrapper" not in marker:
                    errors.append(f"{where}: `run` calls the wrapper's doctest_run(): name the "
                                  "wrapper (wrapper=NAME)")
                block["wrapper"] = None
                if "wrapper" in marker:
                    try:
                        block["wrapper"] = read_wrapper(source_dir, marker["wrapper"], where)
                    except DocError as e:
                        errors.append(str(e))
                block["expected_output"] = None
                block["vary"] = None
                cases.append(block)
                last_cpp = block
            else:
                others[block["lang"] or "(none)"] = others.get(block["lang"] or "(none)", 0) + 1
                if not marker:
                    continue
                if set(marker) - {"output", "vary"} or "output" not in marker:
                    errors.append(f"{where}: a {block['lang'] or 'plain'} block takes only "
                                  "'output' (and 'vary'): what the C++ block before it prints")
                    continue
                if last_cpp is None or "run" not in last_cpp["marker"]:
                    errors.append(f"{where}: 'output' needs a C++ block marked `run` before it")
                    continue
                if last_cpp["expected_output"] is not None:
                    errors.append(f"{where}: the block at line {last_cpp['line']} already has "
                                  "its output")
                    continue
                if "vary" in marker:
                    try:
                        re.compile(marker["vary"])
                    except re.error as e:
                        errors.append(f"{where}: vary is not a regular expression ({e})")
                last_cpp["expected_output"] = "\n".join(block["body"])
                last_cpp["vary"] = marker.get("vary")
                last_cpp["output_line"] = block["line"]
                if OUTPUT_DELIMITER in last_cpp["expected_output"]:
                    errors.append(f"{where}: the output holds '{OUTPUT_DELIMITER}'")
    if errors:
        raise DocError("\n".join(errors))
    return cases, others


def c_string(text):
    return json.dumps(text)  # a JSON string is a valid C++ string literal for this text


def block_namespace(block):
    return f"idem_doctest_{slug_of(block['doc'])}_L{block['line']}"


def render_block(block):
    """The C++ of one block: its includes (and its wrapper's) first, then the block inside its
    wrapper, in a namespace of its own; #line directives point compiler messages at the doc and
    the wrapper."""
    doc, first = block["doc"], block["line"] + 1
    body = [(line, doc, first + n) for n, line in enumerate(block["body"])]
    if block["wrapper"]:
        wrapper = block["wrapper"]["lines"]
        at = block["wrapper"]["at"]
        lines = wrapper[:at] + body + wrapper[at + 1:]
        out = [f"// {doc}:{block['line']} (wrapper {block['wrapper']['name']})"]
    else:
        lines = body
        out = [f"// {doc}:{block['line']} (no wrapper: at namespace scope)"]
    for text, path, n in lines:
        if INCLUDE.match(text):
            out += [f'#line {n} "{path}"', text]
    ns = block_namespace(block)
    out.append(f"namespace {ns} {{")
    at = None
    for text, path, n in lines:
        if at != (path, n):
            out.append(f'#line {n} "{path}"')
        out.append("" if INCLUDE.match(text) else text)
        at = (path, n + 1)
    out.append(f"}}  // namespace {ns}")
    return out


def write_if_changed(path, text):
    try:
        with open(path, encoding="utf-8") as f:
            if f.read() == text:
                return
    except FileNotFoundError:
        pass
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def generate(source_dir, out_dir):
    cases, others = collect(source_dir)
    os.makedirs(out_dir, exist_ok=True)
    header = ["// Generated by tests/doctest/doctest.py; do not edit (edit the doc instead).",
              '#include "doctest_support.hpp"', ""]
    sources, fails, programs, manifest_files = [], [], [], []
    by_doc = {}
    for case in cases:
        by_doc.setdefault(case["doc"], []).append(case)
    for doc, doc_cases in by_doc.items():
        compiled = [c for c in doc_cases
                    if "compile_fail" not in c["marker"] and "program" not in c["marker"]]
        entry = {"doc": doc, "compiled": len(compiled), "run": 0, "compile_fail": [],
                 "programs": []}
        if compiled:
            lines = list(header)
            registrations = []
            for case in compiled:
                lines += render_block(case) + [""]
                run = "run" in case["marker"]
                entry["run"] += run
                registrations.append(
                    "    {%d, %s, %s, %s, %s}," % (
                        case["line"],
                        c_string(case["wrapper"]["name"] if case["wrapper"] else ""),
                        f"&{block_namespace(case)}::doctest_run" if run else "nullptr",
                        (f'R"{OUTPUT_DELIMITER}({case["expected_output"]}){OUTPUT_DELIMITER}"'
                         if case["expected_output"] is not None else "nullptr"),
                        c_string(case["vary"]) if case["vary"] else "nullptr"))
            name = f"doc_{slug_of(doc)}.cpp"
            lines.append(f'#line {len(lines) + 2} "{name}"')
            lines += ["namespace {",
                      f"const idem_doctest::File registration{{{c_string(doc)}, {{"]
            lines += registrations
            lines += ["}};", "}  // namespace", ""]
            write_if_changed(os.path.join(out_dir, name), "\n".join(lines))
            sources.append(name)
        for case in doc_cases:
            if "program" not in case["marker"]:
                continue
            # A complete program: its own translation unit and executable, at global scope.
            target = f"idem_doctest_program_{slug_of(doc)}_L{case['line']}"
            name = target + ".cpp"
            text = [f"// Generated by tests/doctest/doctest.py from {doc}:{case['line']}; do not "
                    "edit (edit the doc instead).", f'#line {case["line"] + 1} "{doc}"']
            write_if_changed(os.path.join(out_dir, name), "\n".join(text + case["body"] + [""]))
            programs.append({"target": target, "source": name, "doc": doc, "line": case["line"]})
            entry["programs"].append(case["line"])
        for case in doc_cases:
            if "compile_fail" not in case["marker"]:
                continue
            target = f"idem_doctest_fail_{slug_of(doc)}_L{case['line']}"
            name = target + ".cpp"
            write_if_changed(os.path.join(out_dir, name),
                             "\n".join(header + render_block(case) + [""]))
            fails.append({"target": target, "source": name, "doc": doc, "line": case["line"],
                          "expect": case["marker"]["compile_fail"]})
            entry["compile_fail"].append(case["line"])
        manifest_files.append(entry)

    cmake = ["# Generated by tests/doctest/doctest.py; do not edit.",
             "set(IDEM_DOCTEST_SOURCES"]
    cmake += [f'    "{out_dir}/{s}"' for s in sources]
    cmake += [")", "set(IDEM_DOCTEST_FAIL_TARGETS"]
    cmake += [f"    {f['target']}" for f in fails]
    cmake += [")", "set(IDEM_DOCTEST_PROGRAM_TARGETS"]
    cmake += [f"    {p['target']}" for p in programs]
    cmake += [")"]
    for f in fails:
        cmake.append(f'set(IDEM_DOCTEST_FAIL_SOURCE_{f["target"]} "{out_dir}/{f["source"]}")')
    for p in programs:
        cmake.append(f'set(IDEM_DOCTEST_PROGRAM_SOURCE_{p["target"]} "{out_dir}/{p["source"]}")')
    write_if_changed(os.path.join(out_dir, "doctests.cmake"), "\n".join(cmake) + "\n")
    manifest = {"files": manifest_files, "fails": fails, "programs": programs,
                "other_blocks": others,
                "compiled": sum(f["compiled"] for f in manifest_files),
                "run": sum(f["run"] for f in manifest_files)}
    write_if_changed(os.path.join(out_dir, "manifest.json"), json.dumps(manifest, indent=1))
    print(f"doctest: {manifest['compiled']} C++ blocks to compile in {len(sources)} translation "
          f"units ({manifest['run']} to run), {len(programs)} programs to compile and run, "
          f"{len(fails)} that must not compile")


def build(build_dir, target, config):
    command = ["cmake", "--build", build_dir, "--target", target]
    if config:
        command += ["--config", config]
    return subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test(args):
    ok = True
    start = time.monotonic()
    result = build(args.build_dir, "idem_doctests", args.config)
    built = time.monotonic() - start
    if result.returncode != 0:
        print(result.stdout)
        print(f"doctest: FAILED to compile the doc blocks ({built:.1f} s); the messages above "
              "name the doc file and line")
        return 1
    # Read after the build: a doc edited since the last configure was extracted again by it.
    with open(args.manifest, encoding="utf-8") as f:
        manifest = json.load(f)
    print(f"doctest: compiled {manifest['compiled']} C++ blocks of "
          f"{sum(1 for f in manifest['files'] if f['compiled'])} doc files in {built:.1f} s")
    start = time.monotonic()
    run = subprocess.run([args.binary], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True)
    ran = time.monotonic() - start
    print(run.stdout, end="")
    if run.returncode != 0:
        print(f"doctest: FAILED: a block that runs failed its check ({ran:.1f} s)")
        ok = False
    else:
        counted = re.search(r"^idem_doctests: (\d+) blocks compiled", run.stdout, re.M)
        if not counted or int(counted.group(1)) != manifest["compiled"]:
            print("doctest: FAILED: the binary holds another number of blocks than the docs "
                  f"({counted.group(1) if counted else 'none'} against {manifest['compiled']})")
            ok = False
    start = time.monotonic()
    for program in manifest["programs"]:
        where = f"{program['doc']}:{program['line']}"
        result = build(args.build_dir, program["target"], args.config)
        if result.returncode != 0:
            print(result.stdout)
            print(f"doctest: FAILED: the program {where} does not compile (output above)")
            ok = False
            continue
        run_program = subprocess.run([os.path.join(args.programs_dir, program["target"])],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if run_program.returncode != 0:
            print(run_program.stdout)
            print(f"doctest: FAILED: the program {where} exited with {run_program.returncode}")
            ok = False
        else:
            print(f"doctest: the program {where} compiled and ran (exit 0)")
    programs_in = time.monotonic() - start
    start = time.monotonic()
    for fail in manifest["fails"]:
        where = f"{fail['doc']}:{fail['line']}"
        result = build(args.build_dir, fail["target"], args.config)
        if result.returncode == 0:
            print(f"doctest: FAILED: {where} is marked compile_fail but compiles")
            ok = False
        elif not re.search(fail["expect"], result.stdout):
            print(result.stdout)
            print(f"doctest: FAILED: {where} does not compile, but not with "
                  f"/{fail['expect']}/ (output above)")
            ok = False
        else:
            print(f"doctest: {where} does not compile, as marked (/{fail['expect']}/)")
    failed_in = time.monotonic() - start
    others = ", ".join(f"{n} {lang}" for lang, n in sorted(manifest["other_blocks"].items()))
    total = manifest["compiled"] + len(manifest["programs"]) + len(manifest["fails"])
    print(f"doctest: {total} C++ blocks: {manifest['compiled']} compiled ({built:.1f} s), "
          f"{manifest['run']} of them run ({ran:.1f} s); {len(manifest['programs'])} programs "
          f"compiled and run ({programs_in:.1f} s); {len(manifest['fails'])} checked not to "
          f"compile ({failed_in:.1f} s); not C++, not compiled: {others}")
    print("doctest: passed" if ok else "doctest: FAILED")
    return 0 if ok else 1


def list_blocks(source_dir):
    cases, _ = collect(source_dir)
    for case in cases:
        marker = " ".join(k if v is True else f"{k}={v}" for k, v in case["marker"].items())
        print(f"{case['doc']}:{case['line']}: {marker or '(no marker: namespace scope)'}")
    print(f"{len(cases)} C++ blocks")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate")
    g.add_argument("--source-dir", required=True)
    g.add_argument("--out", required=True)
    t = sub.add_parser("test")
    t.add_argument("--build-dir", required=True)
    t.add_argument("--manifest", required=True)
    t.add_argument("--binary", required=True)
    t.add_argument("--programs-dir", required=True)
    t.add_argument("--config", default="")
    ls = sub.add_parser("list")
    ls.add_argument("--source-dir", default=os.path.join(os.path.dirname(__file__), "..", ".."))
    args = parser.parse_args()
    try:
        if args.command == "generate":
            generate(args.source_dir, args.out)
            return 0
        if args.command == "list":
            list_blocks(args.source_dir)
            return 0
        return test(args)
    except DocError as e:
        print(e, file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
