#pragma once
/// @file
/// @brief The store conformance suite, installed: the typed GoogleTest suite every idem store
/// passes, for a store of your own to run the same tests. Needs GoogleTest (link GTest::gtest
/// or GTest::gtest_main); idem itself links it nowhere else.
///
/// You write one environment type per store and instantiate the suite with it:
/// @code
/// #include <idem/testing/conformance.hpp>
///
/// struct MyEnv {
///     using Store = MyStore;                       // what is tested
///     static constexpr const char* name = "mine";  // the test names' suffix
///     std::chrono::system_clock::time_point now = idem::testing::conformance_epoch();
///     std::unique_ptr<Store> store;                // fresh for each test, on a clock reading
///     `now` MyEnv() : store(std::make_unique<Store>(/* ..., */ [this] { return now; })) {}
///     template <class Tx>
///     static void write_effect(Tx& tx, const std::string& key);  // one row, in tx
///     std::size_t effect_rows();                    // committed rows written by write_effect
///     bool has_effect(const std::string& key);     // a committed row with this key
/// };
/// INSTANTIATE_TYPED_TEST_SUITE_P(Mine, IdemStoreConformance, ::testing::Types<MyEnv>,
///                                idem::testing::ConformanceNames);
/// @endcode
///
/// The environment (one is constructed per test, so each test gets a fresh store):
///   Store                      the store type; it must fit idem::check_store<Store>(), and
///                              offer find_claim(), dead_letters() and purge() (contract/store.hpp)
///   name                       `static constexpr const char* name`: the instantiation's suffix
///   now                        the time the store's clock reads; tests move it
///   store                      pointer-like (`*env.store` is the Store), built in the
///                              constructor on a clock reading `now`
///   write_effect(tx, key)      static: the effect's write through the claim's transaction
///   effect_rows(), has_effect(key)  what committed, read outside any transaction
/// Optional, detected:
///   make_commit_fail(tx)       makes this transaction's commit really fail (a deferred
///                              constraint, a quota, an injected fault); without it the two
///                              commit-failure tests are skipped
///   static bool available(std::string* why)  false when the store's server is missing: the
///                              tests are skipped with `why`, and fail instead under CI=true
///   static constexpr bool local_effects = true  every effect is declared idem::local_effect
///   static constexpr std::chrono::milliseconds purge_granularity  the store purges claims a
///                              whole span at a time (spans of this length, aligned to
///                              conformance_epoch()): the purge test lets a claim stay until
///                              its span has expired
///   stop_server(), start_server()  take the store's server down (kill it; for a store with no
///                              server, make it unreachable another way, e.g. MemoryStore::
///                              inject(Fault::begin, n)) and bring it back: the probe test
///                              checks idem::probe_store() fails (store_unavailable or
///                              store_timeout) while it is down and passes once it is back.
///                              Without them that test FAILS, naming what to add: a probe that
///                              passes while the server is down keeps a consumer pulling
///                              through the outage
/// Store capabilities the suite looks for (idem/contract/store.hpp): with Tx::try_lock and
/// Store::hold_lock / release_lock the overlap-lock tests run, else they are skipped; with
/// stored_offset() (idem::has_stored_offsets, idem/contract/stored_offset.hpp) the stored-offset
/// tests run, else they check that the store refuses an offset hook.
///
/// A store with redrive() and an outbox (contract/redrive.hpp) also passes the redrive suite,
/// IdemRedriveConformance: its environment adds refuse_redrives() and accept_redrives(), which
/// make the store's redrive transactions really fail and work again, and may add
/// `std::unique_ptr<Store> another_store()` (a second connection on the same data) for its race
/// (conformance/redrive.hpp).
/// @code
/// INSTANTIATE_TYPED_TEST_SUITE_P(Mine, IdemRedriveConformance, ::testing::Types<MyEnv>,
///                                idem::testing::ConformanceNames);
/// @endcode
///
/// A store that keeps its data across a restart (every store but a memory fake) also passes
/// the durability suite, IdemDurableStoreConformance: its environment adds `void reopen()`,
/// which closes the store and opens it again on the same data.
/// @code
/// INSTANTIATE_TYPED_TEST_SUITE_P(Mine, IdemDurableStoreConformance, ::testing::Types<MyEnv>,
///                                idem::testing::ConformanceNames);
/// @endcode

#include "idem/testing/conformance/claims.hpp"
#include "idem/testing/conformance/durability.hpp"
#include "idem/testing/conformance/offsets.hpp"
#include "idem/testing/conformance/payloads.hpp"
#include "idem/testing/conformance/probe.hpp"
#include "idem/testing/conformance/redrive.hpp"
#include "idem/testing/conformance/suite.hpp"
#include "idem/testing/conformance/transactions.hpp"

REGISTER_TYPED_TEST_SUITE_P(
    IdemStoreConformance, NewIdIsProcessedAndAcked, RedeliveryIsDuplicateAndEffectRunsOnce,
    ClaimsAreScopedPerHandler, PoisonLimitDeadLettersWithoutRunningTheEffect,
    BelowThePoisonLimitTheEffectRuns, DuplicateDetectionComesBeforeThePoisonCheck,
    ThrowingEffectLeavesNothingAndIsNotAcked, FailedCommitLeavesNothingAndIsNotAcked,
    RejectedKeepsTheClaimButNotTheEffectsWrites, DeferredStoresNothingAndIsNotAcked,
    MalformedMessageIsDeadLetteredWithItsPayload, MalformedDeliveriesAreDeadLetteredNeverCrash,
    ZeroCountIsParkedWithItsClaimSoOneIdHasOneOutcome, HostileIdsRoundTripExactly,
    TransactionRollsBackWhenDroppedAndSavepointsNest,
    ClaimInsideOneTransactionSeesItsOwnClaimAsDuplicate,
    PurgeRemovesOnlyClaimsOlderThanTheRetention, PurgeRemovesExpiredLocksButNotLiveOnes,
    ConcurrentThreadsApplyEachEffectOnce, BatchCommitsTogetherAndAFailingMessageRollsBackAlone,
    LargeBatchesClaimEachIdOnceAcrossChunks, BatchWhoseCommitFailsAcksNothing,
    EmptyBatchAndMismatchedSizes, ReusedIdWithAnotherPayloadIsDeadLetteredNotAcked,
    TakeoverOfAReleasedClaimStoresTheNewPayloadsFingerprint,
    DeadLetterPayloadIsRedactedBeforeTheStoreKeepsIt,
    ClaimWithoutFingerprintCannotBeComparedSoItIsADuplicate,
    MessageOlderThanTheGatewayKeyLifetimeIsNotSentBlindly,
    ReconcileCallbackTakesMessagesOlderThanTheKeyLifetime,
    OverlapLockDefersWhileAnotherJobHoldsTheEntity, OverlapLockExpiresWhenItsHolderDies,
    OverlapLockCanDropTheBlockedCopy, StoredOffsetIsNulloptUntilACommitStoresOne,
    StoredOffsetCommitsWithTheClaimAndTheEffect, StoredOffsetOfARolledBackTransactionIsNotWritten,
    StoredOffsetNeverMovesBack, DeadLetteredMessagesOffsetWaitsForTheBroker,
    StoredOffsetsOfABatchAreThoseOfItsCommittedMessages,
    StoredOffsetsAreKeptPerGroupTopicAndPartition, StoredOffsetKeysAreBinarySafe,
    ProbeFailsWhileTheServerIsDownAndPassesOnceItIsBack);

REGISTER_TYPED_TEST_SUITE_P(IdemDurableStoreConformance, ProcessedClaimSurvivesReopeningTheStore,
                            DeadLetterSurvivesReopeningTheStore,
                            StoredOffsetSurvivesReopeningTheStore);

REGISTER_TYPED_TEST_SUITE_P(
    IdemRedriveConformance, RedrivenMessageIsProcessedOnceWhenTheRelayDeliversIt,
    RedrivingTwiceWritesOneIntent, MessageProcessedMeanwhileIsReportedNotRerun,
    DryRunChangesNothing, RedrivenMessageGetsAFreshPoisonLimit,
    ConcurrentRedrivesWriteOneIntentPerMessage, FailedRedriveLeavesNothingAndARerunRedrivesOnce,
    MessageParkedAgainKeepsItsHistory, SelectionTakesScopeIdsReasonTimeAndLimitOldestFirst,
    ListingWalksEveryEntryPastManyPages, PurgeDeletesOnlyTheSelectedEntriesAndKeepsTheirClaims,
    ARateSpacesTheRedrives, WithoutADestinationEachMessageGoesBackToItsOrigin,
    ADeadLetterSaysHowAndWhenItsEffectFailed, ABatchNotesEachFailedEffect);
// Optional: a store without redrive() (examples/journal_store) does not
// instantiate it, and GoogleTest must not fail it for that.
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(IdemRedriveConformance);
