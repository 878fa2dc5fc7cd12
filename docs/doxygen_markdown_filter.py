#!/usr/bin/env python3
"""Doxygen's INPUT_FILTER for README.md and docs/*.md (docs/Doxyfile's FILTER_PATTERNS).

Doxygen 1.9 turns a link to `page.md#section` into a reference to the label `section`, but gives
a Markdown heading no label of its own. This filter gives each heading the label GitHub gives it
(lower case, punctuation dropped, spaces as '-'), so the links that work on GitHub work in the
reference too. Labels are global in Doxygen and pages share headings ("Schema"), so each label
is prefixed with its page (`stores-fork`; the title's label is the page's name, `stores`, which
names its HTML file), and the links are rewritten to match: `page.md#x`
becomes `#page-x`, `#x` becomes `#<this page>-x`. Fenced code blocks are passed through untouched.
The file on disk is not changed.
"""
import os
import re
import sys

seen = {}


def slug(title):
    text = re.sub(r"[`*_]", "", title.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def page(path):
    return slug(os.path.splitext(os.path.basename(path))[0])


def relink(line, this_page):
    def anchored(match):
        target, anchor = match.group(1), match.group(2)
        target_page = page(target) if target else this_page
        return f"](#{target_page}-{anchor})"

    return re.sub(r"\]\(([^()\s#]*\.md)?#([^()\s]+)\)", anchored, line)


def escape_code_spans(line):
    # Doxygen 1.9 reads some <name> inside a code span as an HTML tag; the entities show as < >.
    return re.sub(r"`[^`]+`", lambda m: m.group(0).replace("<", "&lt;").replace(">", "&gt;"), line)


def main():
    this_page = page(sys.argv[1])
    titled = False
    fence = None
    lines = iter(open(sys.argv[1], encoding="utf-8"))
    for line in lines:
        stripped = line.rstrip("\n")
        # A code span that goes on over the next line: Doxygen 1.9 closes it at the line's end,
        # so the lines are joined (a soft line break is a space in Markdown anyway).
        while fence is None and stripped.count("`") % 2 and not stripped.lstrip().startswith("```"):
            following = next(lines, None)
            if following is None:
                break
            stripped += " " + following.strip()
        marker = re.match(r"^\s*(```+|~~~+)", stripped)
        if marker:
            if fence is None:
                fence = marker.group(1)
            elif marker.group(1).startswith(fence):
                fence = None
        heading = None if fence else re.match(r"^(#{1,6})\s+(.*?)\s*$", stripped)
        if heading and "{#" not in stripped:
            label = slug(heading.group(2))
            count = seen.get(label, 0)
            seen[label] = count + 1
            if count:
                label = f"{label}-{count}"
            if heading.group(1) == "#" and not titled:
                label = this_page  # the page's title: the page is <page>.html
                titled = True
            else:
                label = f"{this_page}-{label}"
            stripped = f"{heading.group(1)} {heading.group(2)} {{#{label}}}"
        elif not fence and not marker:
            stripped = escape_code_spans(relink(stripped, this_page))
        sys.stdout.write(stripped + "\n")


main()
