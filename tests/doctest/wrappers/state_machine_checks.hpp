// Doc-test wrapper `state_machine_checks`: the block declares a state machine at namespace
// scope; the static_asserts check the verdicts the doc's table gives for it.
#include <idem/state_machine.hpp>

// @block

static_assert(*payment_flow.initial() == PaymentState::none);
static_assert(payment_flow.classify(PaymentState::none, PaymentEvent::authorise).verdict ==
              idem::Verdict::allowed);
static_assert(payment_flow.classify(PaymentState::none, PaymentEvent::capture).verdict ==
              idem::Verdict::early);
static_assert(payment_flow.classify(PaymentState::authorised, PaymentEvent::authorise).verdict ==
              idem::Verdict::stale);
static_assert(payment_flow.classify(PaymentState::refunded, PaymentEvent::capture).verdict ==
              idem::Verdict::stale);
