// idem::kafka::OffsetLedger on its own, no cluster: the offset a partition commits only moves
// past records settled with none before them unsettled; a retried record holds back the ones
// after it; a partition is read again from the first record handed out and not settled, or
// dropped; a commit in flight is not sent twice, and a refused one is sent again.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>

#include <idem/kafka/offset_ledger.hpp>

namespace {

namespace kafka = idem::kafka;
using kafka::OffsetLedger;
using kafka::TopicPartition;
using kafka::TopicPartitions;

std::int64_t done_of(const OffsetLedger& ledger, const std::string& topic, std::int32_t partition) {
    for (const TopicPartition& p : ledger.positions()) {
        if (p.topic == topic && p.partition == partition) return p.offset;
    }
    ADD_FAILURE() << topic << "/" << partition << " is not assigned";
    return -1;
}

TEST(KafkaOffsetLedger, DoneMovesOnlyPastRecordsSettledInOrder) {
    OffsetLedger ledger;
    ledger.assign("t", 0);
    EXPECT_EQ(done_of(ledger, "t", 0), RD_KAFKA_OFFSET_INVALID);
    for (std::int64_t offset = 10; offset < 13; ++offset)
        EXPECT_EQ(ledger.hand_out("t", 0, offset), std::optional<std::uint32_t>(1));
    EXPECT_EQ(done_of(ledger, "t", 0), 10);  // the first record handed out: nothing past it yet
    ledger.settle("t", 0, 11);
    EXPECT_EQ(done_of(ledger, "t", 0), 10);  // 10 is not settled: done stays before it
    ledger.settle("t", 0, 10);
    EXPECT_EQ(done_of(ledger, "t", 0), 12);  // 10 and 11 settled
    ledger.settle("t", 0, 12);
    EXPECT_EQ(done_of(ledger, "t", 0), 13);
}

TEST(KafkaOffsetLedger, ARecordSettledOrHandedOutAlreadyIsNotHandedOutAgain) {
    OffsetLedger ledger;
    ledger.assign("t", 0, 5);  // a start read from the store: done already
    EXPECT_EQ(ledger.hand_out("t", 0, 4), std::nullopt);  // before the start: settled
    EXPECT_EQ(ledger.hand_out("t", 0, 5), std::optional<std::uint32_t>(1));
    EXPECT_EQ(ledger.hand_out("t", 0, 5), std::nullopt);  // outstanding already
    EXPECT_EQ(ledger.hand_out("t", 1, 0), std::nullopt);  // not assigned
}

TEST(KafkaOffsetLedger, ARetriedRecordHoldsBackTheRecordsAfterItAndCountsItsTries) {
    OffsetLedger ledger;
    ledger.assign("t", 0);
    ASSERT_TRUE(ledger.hand_out("t", 0, 0));
    ASSERT_TRUE(ledger.hand_out("t", 0, 1));
    EXPECT_FALSE(ledger.blocked("t", 0, 1));
    EXPECT_TRUE(ledger.retry("t", 0, 0, 1));
    EXPECT_TRUE(ledger.blocked("t", 0, 1));   // after the retried one, which is not settled
    EXPECT_FALSE(ledger.blocked("t", 0, 0));  // the retried one itself
    EXPECT_TRUE(ledger.blocked("u", 0, 0));   // not assigned
    EXPECT_FALSE(ledger.retry("u", 0, 0, 1));

    // Read again from the retried record: its next attempt is the second.
    const TopicPartitions rewinds = ledger.rewinds();
    ASSERT_EQ(rewinds.size(), 1U);
    EXPECT_EQ(rewinds[0], (TopicPartition{"t", 0, 0}));
    ledger.rewound(rewinds[0]);
    EXPECT_EQ(ledger.hand_out("t", 0, 0), std::optional<std::uint32_t>(2));
    ledger.settle("t", 0, 0);
    EXPECT_FALSE(ledger.blocked("t", 0, 1));
    EXPECT_EQ(done_of(ledger, "t", 0), 1);
}

TEST(KafkaOffsetLedger, AnInterruptedRecordStartsItsTriesAgain) {
    OffsetLedger ledger;
    ledger.assign("t", 0);
    ASSERT_TRUE(ledger.hand_out("t", 0, 7));
    ledger.rewound(ledger.rewinds().at(0));  // a stop: no retry was asked for
    EXPECT_EQ(ledger.hand_out("t", 0, 7), std::optional<std::uint32_t>(1));
}

TEST(KafkaOffsetLedger, APartitionIsReadAgainFromItsEarliestDroppedRecordUntilASeekSucceeds) {
    OffsetLedger ledger;
    ledger.assign("t", 0);
    ASSERT_TRUE(ledger.hand_out("t", 0, 0));
    ledger.settle("t", 0, 0);          // done: 1
    ledger.rewind_at_most("t", 0, 0);  // settled already: ignored
    EXPECT_FALSE(ledger.must_rewind("t", 0));
    ledger.rewind_at_most("t", 0, 4);
    ledger.rewind_at_most("t", 0, 2);
    ledger.rewind_at_most("t", 0, 3);
    EXPECT_TRUE(ledger.must_rewind("t", 0));
    // A seek that failed leaves it due: rewinds() says it again.
    EXPECT_EQ(ledger.rewinds(), (TopicPartitions{{"t", 0, 2}}));
    EXPECT_EQ(ledger.rewinds(), (TopicPartitions{{"t", 0, 2}}));
    ledger.rewound(TopicPartition{"t", 0, 2});
    EXPECT_FALSE(ledger.must_rewind("t", 0));
    EXPECT_TRUE(ledger.rewinds().empty());
}

TEST(KafkaOffsetLedger, AfterAStoreOutageEveryPartitionIsReadAgainFromItsDoneOffset) {
    OffsetLedger ledger;
    ledger.assign("t", 0);
    ledger.assign("t", 1);  // nothing read yet: nothing to read again
    ASSERT_TRUE(ledger.hand_out("t", 0, 3));
    ledger.settle("t", 0, 3);
    ledger.rewind_all_to_done();
    EXPECT_EQ(ledger.rewinds(), (TopicPartitions{{"t", 0, 4}}));
}

TEST(KafkaOffsetLedger, ACommitInFlightIsNotSentTwiceAndARefusedOneIsSentAgain) {
    OffsetLedger ledger;
    ledger.assign("t", 0);
    ledger.assign("t", 1);
    EXPECT_TRUE(ledger.to_commit(true).empty());  // nothing done yet
    ASSERT_TRUE(ledger.hand_out("t", 0, 0));
    ledger.settle("t", 0, 0);
    const TopicPartitions sent = ledger.to_commit(true);
    EXPECT_EQ(sent, (TopicPartitions{{"t", 0, 1}}));
    EXPECT_TRUE(ledger.to_commit(true).empty());  // in flight
    EXPECT_EQ(ledger.to_commit(false), sent);     // a sync commit sends it anyway

    ledger.note_committed(RD_KAFKA_RESP_ERR_REBALANCE_IN_PROGRESS, sent);  // refused
    EXPECT_EQ(ledger.to_commit(true), sent);                               // sent again
    TopicPartitions answer = sent;
    answer[0].error = RD_KAFKA_RESP_ERR_UNKNOWN_MEMBER_ID;  // the partition's own error
    ledger.note_committed(RD_KAFKA_RESP_ERR_NO_ERROR, answer);
    EXPECT_EQ(ledger.to_commit(true), sent);
    ledger.note_committed(RD_KAFKA_RESP_ERR_NO_ERROR, sent);  // confirmed
    EXPECT_TRUE(ledger.to_commit(true).empty());
    EXPECT_TRUE(ledger.to_commit(false).empty());

    // Only the partitions asked for (a revocation's).
    ASSERT_TRUE(ledger.hand_out("t", 1, 0));
    ledger.settle("t", 1, 0);
    ASSERT_TRUE(ledger.hand_out("t", 0, 1));
    ledger.settle("t", 0, 1);
    const TopicPartitions only{{"t", 1}};
    EXPECT_EQ(ledger.to_commit(false, &only), (TopicPartitions{{"t", 1, 1}}));
}

TEST(KafkaOffsetLedger, PausesEndWhenTheyAreDue) {
    OffsetLedger ledger;
    ledger.assign("t", 0);
    ledger.assign("t", 1);
    const auto now = std::chrono::steady_clock::now();
    EXPECT_FALSE(ledger.paused("t", 0));
    ledger.paused_until("t", 0, now + std::chrono::seconds(1));
    EXPECT_TRUE(ledger.paused("t", 0));
    EXPECT_EQ(ledger.unpaused(), (TopicPartitions{{"t", 1}}));
    EXPECT_TRUE(ledger.take_due(now).empty());
    EXPECT_EQ(ledger.take_due(now + std::chrono::seconds(1)), (TopicPartitions{{"t", 0}}));
    EXPECT_FALSE(ledger.paused("t", 0));
}

TEST(KafkaOffsetLedger, AForgottenPartitionIsNoLongerKept) {
    OffsetLedger ledger;
    ledger.assign("t", 0);
    ledger.assign("t", 1);
    EXPECT_EQ(ledger.partitions(), (TopicPartitions{{"t", 0}, {"t", 1}}));
    ledger.forget("t", 0);
    EXPECT_FALSE(ledger.owns("t", 0));
    EXPECT_TRUE(ledger.owns("t", 1));
    ledger.settle("t", 0, 0);  // no effect on a partition not kept
    ledger.rewind_at_most("t", 0, 0);
    EXPECT_EQ(ledger.partitions(), (TopicPartitions{{"t", 1}}));
    ledger.clear();
    EXPECT_TRUE(ledger.partitions().empty());
}

}  // namespace
