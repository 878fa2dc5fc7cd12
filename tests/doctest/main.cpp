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

/// What the output block's `vary` regex matches may differ from run to run (a duration): it is
/// replaced by "<varies>" in the doc's line and in the printed one before they are compared.
std::string normalised(const std::string& line, const char* vary) {
    if (vary == nullptr) return line;
    return std::regex_replace(line, std::regex(vary), "<varies>");
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
            std::string threw;
            try {
                block.run();
            } catch (const std::exception& e) {
                threw = e.what();
            } catch (...) {
                threw = "a non-standard exception";
            }
            std::cout.rdbuf(saved);
            bool ok = threw.empty();
            if (!ok) std::cerr << file.doc << ":" << block.line << ": threw: " << threw << "\n";
            if (idem_doctest::failed_checks() != checks_before) ok = false;
            if (ok && block.expected_output != nullptr)
                ok = same_output(printed.str(), block, file.doc);
            if (!ok) {
                ++failed;
                std::cerr << file.doc << ":" << block.line << ": FAILED (wrapper " << block.wrapper
                          << ")\n";
            }
        }
        std::cout << "  " << file.doc << ": " << file.blocks.size() << " compiled, " << ran_here
                  << " run" << std::endl;
    }
    std::cout << "idem_doctests: " << compiled << " blocks compiled, " << run << " run, " << failed
              << " failed\n";
    return failed == 0 ? 0 : 1;
}
