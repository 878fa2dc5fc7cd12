// The doc-test binary's main (tests/doctest/doctest.py): every block of README.md and docs/ is
// compiled into this program; those marked `run` are run here, their checks counted and, with
// an `output` block, what they print to std::cout compared with it.

#include <exception>
#include <iostream>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "doctest_support.hpp"

namespace {

std::vector<std::string> lines_of(const std::string& text) {
    std::vector<std::string> lines;
    std::istringstream in(text);
    for (std::string line; std::getline(in, line);)
        lines.push_back(line);
    while (!lines.empty() && lines.back().empty())
        lines.pop_back();
    return lines;
}

/// In a line matching @p vary every number is '#': what may differ from run to run (a time).
std::string normalised(const std::string& line, const char* vary) {
    if (vary == nullptr || !std::regex_search(line, std::regex(vary))) return line;
    static const std::regex number(R"([-+]?[0-9]+(\.[0-9]+)?([eE][-+]?[0-9]+)?)");
    return std::regex_replace(line, number, "#");
}

bool same_output(const std::string& printed, const idem_doctest::Block& block, const char* doc) {
    const std::vector<std::string> got = lines_of(printed);
    const std::vector<std::string> want = lines_of(block.expected_output);
    for (std::size_t i = 0; i < got.size() || i < want.size(); ++i) {
        const std::string g = i < got.size() ? normalised(got[i], block.vary) : "<nothing>";
        const std::string w = i < want.size() ? normalised(want[i], block.vary) : "<nothing>";
        if (g != w) {
            std::cerr << doc << ":" << block.line << ": output line " << i + 1
                      << " differs from the doc's\n  doc:     " << w << "\n  printed: " << g
                      << "\n";
            return false;
        }
    }
    return true;
}

}  // namespace

int main() {
    std::size_t compiled = 0, run = 0, failed = 0;
    for (const auto& file : idem_doctest::registry()) {
        std::size_t ran_here = 0;
        for (const auto& block : file.blocks) {
            ++compiled;
            if (block.run == nullptr) continue;
            ++run;
            ++ran_here;
            const int checks_before = idem_doctest::failed_checks();
            std::ostringstream printed;
            std::streambuf* saved = std::cout.rdbuf(printed.rdbuf());
            bool ok = true;
            try {
                block.run();
            } catch (const std::exception& e) {
                std::cerr << file.doc << ":" << block.line << ": threw: " << e.what() << "\n";
                ok = false;
            } catch (...) {
                std::cerr << file.doc << ":" << block.line << ": threw a non-standard exception\n";
                ok = false;
            }
            std::cout.rdbuf(saved);
            if (idem_doctest::failed_checks() != checks_before) ok = false;
            if (ok && block.expected_output != nullptr)
                ok = same_output(printed.str(), block, file.doc);
            if (!ok) {
                ++failed;
                std::cerr << file.doc << ":" << block.line << ": FAILED (wrapper "
                          << block.wrapper << ")\n";
            }
        }
        std::cout << "  " << file.doc << ": " << file.blocks.size() << " compiled, " << ran_here
                  << " run\n";
    }
    std::cout << "idem_doctests: " << compiled << " blocks compiled, " << run << " run, "
              << failed << " failed\n";
    return failed == 0 ? 0 : 1;
}
