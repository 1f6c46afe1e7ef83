#!/usr/bin/env python3
"""Checks every internal link and anchor of the built book (docs/build.sh runs it).

Each relative href or src of every page must name a file of the built book and, with a
fragment, an element with that id in it. External URLs are not fetched (the check is offline)
and not judged. Exits 1 naming every broken link with its page.
"""
import html.parser
import os
import sys
import urllib.parse

SKIPPED_PAGES = {"print.html", "404.html"}  # print.html re-anchors every chapter's links


class Page(html.parser.HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.ids = set()
        self.links = []

    def handle_starttag(self, tag, attrs):
        for name, value in attrs:
            if name in ("id", "name") and value:
                self.ids.add(value)
            if name in ("href", "src") and value is not None:
                self.links.append((tag, value, self.getpos()[0]))


def parse(path, cache):
    if path not in cache:
        page = Page()
        with open(path, encoding="utf-8") as f:
            page.feed(f.read())
        cache[path] = page
    return cache[path]


def main(book):
    cache = {}
    broken = []
    for dirpath, _, files in os.walk(book):
        for name in sorted(files):
            if not name.endswith(".html") or name in SKIPPED_PAGES:
                continue
            path = os.path.join(dirpath, name)
            for tag, link, line in parse(path, cache).links:
                url = urllib.parse.urlsplit(link)
                if url.scheme or link.startswith("//") or link == "":
                    continue
                target = path if url.path == "" else os.path.normpath(
                    os.path.join(dirpath, urllib.parse.unquote(url.path)))
                where = f"{os.path.relpath(path, book)}:{line}: {link}"
                if not os.path.realpath(target).startswith(os.path.realpath(book) + os.sep):
                    broken.append(f"{where} (outside the book)")
                    continue
                if os.path.isdir(target):
                    target = os.path.join(target, "index.html")
                if not os.path.isfile(target):
                    broken.append(f"{where} (no such page)")
                    continue
                frag = urllib.parse.unquote(url.fragment)
                if frag and target.endswith(".html") and frag not in parse(target, cache).ids:
                    broken.append(f"{where} (no anchor #{frag})")
    for b in broken:
        print(f"broken link: {b}", file=sys.stderr)
    if broken:
        print(f"linkcheck: {len(broken)} broken link(s) in {book}", file=sys.stderr)
        return 1
    print(f"linkcheck: every internal link and anchor of {book} resolves")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "target/book"))
