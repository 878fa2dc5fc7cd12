// Doc-test wrapper `redaction`: the block sets PolicyOptions::redact_payload and builds the
// policy; doctest_run() checks what the comment and the hook it installs say.
#include <idem/idem.hpp>

#include <regex>
#include <string>

inline void doctest_run() {
    // @block
    IDEM_DOCTEST_CHECK(idem::mask_card_numbers("card=4111 1111 1111 1111") ==
                       "card=**** **** **** 1111");
    IDEM_DOCTEST_CHECK(policy.redact("card=4111111111111111") == "card=*********1111");
}
